"""A data URL sent again is recognised by a hash of its text (wire/hashing.py, ``KnownDataUrls``): same
mm_hash as its decoded bytes (and the same image by http), the request's byte budget still counted, and
its bytes decoded only when its item must be processed."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace
from typing import Any

import pytest

from app.api.schemas import ChatMessageParam
from app.errors import MediaError
from app.inputs.input_processor import InputProcessor, PreparedRequest
from app.media.fetch import MediaFetcher
from app.media.url_policy import MediaPolicy
from app.metrics import ApiMetrics
from app.settings import Settings
from tests.unit.input_support import prepare_only_family
from wire.hashing import mm_hash
from workers.families.processing import ItemLayout

IMAGE = b"\x89PNG not really, but bytes" * 20


def data_url(data: bytes = IMAGE, gap: str = "") -> str:
    encoded = base64.b64encode(data).decode()
    return "data:image/png;base64," + gap.join(encoded[i : i + 16] for i in range(0, len(encoded), 16))


class FakePool:
    """Stands in for the preprocessing pool: records the bytes it was given."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    async def process(self, data: bytes, options: dict[str, Any], param: str, modality: str = "image") -> Any:
        self.calls.append(data)
        return SimpleNamespace(layout=ItemLayout(4), tensors={}, num_bytes=0)


def make_inputs(settings: Settings, pool: FakePool) -> InputProcessor:
    family = prepare_only_family()
    media = MediaFetcher(MediaPolicy(), None)  # type: ignore[arg-type]  # data URLs only
    return InputProcessor(settings, family, None, None, ApiMetrics(), media, pool)  # type: ignore[arg-type]


def message(*urls: str) -> ChatMessageParam:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatMessageParam.model_validate({"role": "user", "content": parts})


def prepare(inputs: InputProcessor, *urls: str, **kwargs: Any) -> PreparedRequest:
    return asyncio.run(inputs.prepare([message(*urls)], kwargs))


def test_a_known_data_url_keeps_its_mm_hash_and_is_not_decoded_again() -> None:
    inputs = make_inputs(Settings(), FakePool())
    first = prepare(inputs, data_url()).items[0]
    again = prepare(inputs, data_url()).items[0]
    assert first.data == IMAGE and again.data is None
    expected = mm_hash(model_id="m", modality="image", data=IMAGE, options={})  # as by http
    assert first.mm_hash == again.mm_hash == expected


def test_other_text_or_options_are_decoded_and_hashed_as_before() -> None:
    inputs = make_inputs(Settings(), FakePool())
    prepare(inputs, data_url())
    spaced = prepare(inputs, data_url(gap="\n")).items[0]  # other text, same bytes
    assert spaced.data == IMAGE
    assert spaced.mm_hash == mm_hash(model_id="m", modality="image", data=IMAGE, options={})
    with_options = prepare(inputs, data_url(), do_normalize=False).items[0]
    assert with_options.data == IMAGE
    assert with_options.mm_hash == mm_hash(
        model_id="m", modality="image", data=IMAGE, options={"do_normalize": False}
    )


def test_known_data_urls_still_count_against_the_request_budget() -> None:
    inputs = make_inputs(Settings(max_request_image_bytes=2 * len(IMAGE)), FakePool())
    assert len(prepare(inputs, data_url(), data_url()).items) == 2
    with pytest.raises(MediaError) as info:
        prepare(inputs, data_url(), data_url(), data_url())  # all three known
    assert info.value.code == "request_images_too_large"


def test_a_known_data_url_is_decoded_when_its_item_must_be_processed() -> None:
    pool = FakePool()
    inputs = make_inputs(Settings(), pool)
    prepare(inputs, data_url())
    image = prepare(inputs, data_url()).items[0]
    assert image.data is None

    async def run() -> None:
        await inputs._run_once(image)

    asyncio.run(run())
    assert pool.calls == [IMAGE] and image.data == IMAGE
