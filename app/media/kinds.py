"""The kinds of media a request carries. Fetching is the same for each (the media policy); the limits,
the words in messages and the error codes are the kind's own (``image_too_large``, ``video_too_large``)."""

from __future__ import annotations

import enum


class MediaKind(enum.StrEnum):
    IMAGE = "image"
    VIDEO = "video"

    @property
    def noun(self) -> str:
        """``Image`` / ``Video``, to start a message."""
        return self.value.capitalize()

    @property
    def invalid_url_code(self) -> str:
        return f"invalid_{self.value}_url"

    @property
    def forbidden_code(self) -> str:
        return f"{self.value}_url_forbidden"

    @property
    def fetch_failed_code(self) -> str:
        return f"{self.value}_fetch_failed"

    @property
    def too_large_code(self) -> str:
        return f"{self.value}_too_large"

    @property
    def invalid_code(self) -> str:
        return f"invalid_{self.value}"
