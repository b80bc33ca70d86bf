"""A video's URL under the media policy, as an image's is (tests/unit/test_media_fetch.py): ``file://``
under --allowed-local-media-path only, non-public addresses refused before any connection, its own byte
cap; every refusal with the video's own code."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.errors import MediaError
from app.media.fetch import MediaFetcher
from app.media.kinds import MediaKind
from app.media.url_policy import MediaPolicy
from app.media.urls import load_media_bytes
from tests.unit.test_media_fetch import Recorder, no_dns

PARAM = "messages[0].content[0].video_url.url"
CLIP = b"\x00\x00\x00\x18ftypmp42 not really, the fetcher does not decode"


def load(url: str, policy: MediaPolicy) -> tuple[bytes, Recorder]:
    recorder = Recorder()

    async def main() -> bytes:
        async with httpx.AsyncClient(transport=httpx.MockTransport(recorder)) as client:
            fetcher = MediaFetcher(policy, client, no_dns())
            return await load_media_bytes(url, kind=MediaKind.VIDEO, fetcher=fetcher, param=PARAM)

    return asyncio.run(main()), recorder


def code(url: str, policy: MediaPolicy) -> str:
    with pytest.raises(MediaError) as info:
        load(url, policy)
    assert info.value.param == PARAM
    return str(info.value.code)


def test_file_videos_only_inside_the_allowed_folder(tmp_path: Path) -> None:
    root = tmp_path / "videos"
    root.mkdir()
    (root / "a.mp4").write_bytes(CLIP)
    (tmp_path / "secret.mp4").write_bytes(CLIP)
    policy = MediaPolicy(local_media_root=root.resolve())
    assert load(f"file://{root}/a.mp4", policy)[0] == CLIP
    assert code(f"file://{root}/a.mp4", MediaPolicy()) == "video_url_forbidden"
    assert code(f"file://{root}/../secret.mp4", policy) == "video_url_forbidden"
    assert code(f"file://{root}/missing.mp4", policy) == "video_fetch_failed"
    capped = MediaPolicy(local_media_root=root.resolve(), max_video_bytes=len(CLIP) - 1)
    assert code(f"file://{root}/a.mp4", capped) == "video_too_large"


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1/a.mp4", "http://10.0.0.1/a.mp4", "http://169.254.169.254/latest/meta-data/"]
)
def test_non_public_video_hosts_are_refused_before_any_connection(url: str) -> None:
    with pytest.raises(MediaError) as info:
        load(url, MediaPolicy())
    assert info.value.code == "video_url_forbidden"
