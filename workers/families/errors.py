"""The error a family's API half raises for a request it cannot take.

The families live below the API process (docs/architecture.md, "Packages"), so they raise their own type;
the API maps it to a 400 ``invalid_request_error`` naming ``param`` (app/errors.py, ``from_family_error``).
"""

from __future__ import annotations


class FamilyInputError(ValueError):
    """A request's item or options that this family's processor cannot take (a bad
    ``mm_processor_kwargs`` value, an item the model could not encode, a prompt its template refuses)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
