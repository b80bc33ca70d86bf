"""``file://`` media URLs: only under ``--allowed-local-media-path``, never out of it (``..``, a symlink),
within the byte caps; an empty file is no image."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.errors import MediaError
from app.media.fetch import MediaFetcher, RequestImageBudget
from app.media.kinds import MediaKind
from app.media.url_policy import MediaPolicy
from app.media.urls import load_media_bytes
from tests.unit.fetch_support import BODY, PARAM, Recorder, no_dns


def load_file(url: str, policy: MediaPolicy, budget: RequestImageBudget | None = None) -> bytes:
    async def main() -> bytes:
        async with httpx.AsyncClient(transport=httpx.MockTransport(Recorder())) as client:
            fetcher = MediaFetcher(policy, client, no_dns())
            return await load_media_bytes(
                url, kind=MediaKind.IMAGE, fetcher=fetcher, param=PARAM, budget=budget
            )

    return asyncio.run(main())


def test_file_urls_inside_the_allowed_folder(tmp_path: Path) -> None:
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.png").write_bytes(BODY)
    (tmp_path / "secret.png").write_bytes(BODY)
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(local_media_root=root.resolve())
    budget = RequestImageBudget(10_000)
    assert load_file(f"file://{root}/a.png", policy, budget) == BODY and budget.num_bytes == len(BODY)

    def code(url: str, policy: MediaPolicy) -> str | None:
        with pytest.raises(MediaError) as info:
            load_file(url, policy)
        return info.value.code

    assert code(f"file://{root}/../secret.png", policy) == "image_url_forbidden"
    assert code(f"file://{root}/escape.png", policy) == "image_url_forbidden"
    assert code(f"file://{tmp_path}/secret.png", policy) == "image_url_forbidden"
    assert code(f"file://{root}/a.png", MediaPolicy()) == "image_url_forbidden"
    small = MediaPolicy(local_media_root=root.resolve(), max_image_bytes=len(BODY) - 1)
    assert code(f"file://{root}/a.png", small) == "image_too_large"
    (root / "empty.png").write_bytes(b"")
    assert code(f"file://{root}/empty.png", policy) == "invalid_image"
