"""Media ids and cache salts on a real server: a ``uuid`` sent with media names that content for its tenant
and salt; sent alone it is served from the caches without fetching, decoding or encoding, or refused
with 400 ``media_uuid_unknown`` (never another item's answer); ``cache_salt`` shares no cache hit of any
kind across salts, and with ``--tenant-cache-isolation`` (on here) none across API keys."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import PIL.Image
import pytest

from tests.e2e.conftest import data_url, greedy_body, make_image
from tests.e2e.metrics import delta
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow

KEYS = ("sk-tenant-one", "sk-tenant-two")
# room for one processed LLaVA image (1.35 MB) in the processor cache and in the IPC cache: a second
# image evicts the first from both
ONE_ITEM_GB = "0.002"
ENCODER_CACHE_IMAGES = 8192 // 576  # the default encoder-cache space holds 14 LLaVA images


@pytest.fixture(scope="module")
def ids_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = [
        "--api-key",
        KEYS[0],
        "--api-key",
        KEYS[1],
        "--tenant-cache-isolation",
        "--max-model-len",
        "2048",
    ]
    flags += ["--mm-processor-cache-gb", ONE_ITEM_GB, "--mm-ipc-cache-gb", ONE_ITEM_GB]
    with serving(tiny_model_dir, tmp_path_factory.mktemp("media-ids"), *flags) as srv:
        yield srv


def image_part(image: PIL.Image.Image | None, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(image)} if image else None}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def post(server: Server, part: dict[str, Any], key: str = KEYS[0], **extra: Any) -> httpx.Response:
    message = {"role": "user", "content": [part, {"type": "text", "text": "What is in it?"}]}
    body = greedy_body([message], 8, **extra)
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def answer(server: Server, part: dict[str, Any], key: str = KEYS[0], **extra: Any) -> str:
    resp = post(server, part, key, **extra)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def assert_unknown(
    resp: httpx.Response, param: str = "messages[0].content[0].uuid", uuid: str | None = None
) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "media_uuid_unknown" and error["param"] == param
    assert "Send the media again" in error["message"]
    if uuid is not None:  # the message names the id, as the client sent it
        assert f"The media id {uuid!r}" in error["message"], error["message"]


def test_media_then_its_uuid_alone_is_served_without_fetch_decode_or_encode(ids_server: Server) -> None:
    image = make_image(500)
    with_media = answer(ids_server, image_part(image, "cat-1"))
    before = ids_server.metrics()
    alone = answer(ids_server, image_part(None, "cat-1"))
    after = ids_server.metrics()
    assert alone == with_media
    assert delta(before, after, "mmserve_mm_fetch_seconds_count") == 0  # nothing fetched or base64-decoded
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0  # nothing decoded or processed
    assert delta(before, after, "mmserve_encoder_runs_total") == 0
    assert delta(before, after, "mmserve_mm_items_total") == 1
    assert delta(before, after, 'mmserve_mm_uuid_lookups_total{result="hit"}') == 1
    assert after["mmserve_mm_uuid_bindings"] >= 1


def test_unknown_and_other_tenants_uuids_are_refused(ids_server: Server) -> None:
    answer(ids_server, image_part(make_image(501), "mine"))
    before = ids_server.metrics()
    assert_unknown(post(ids_server, image_part(None, "never-sent")), uuid="never-sent")
    assert_unknown(post(ids_server, image_part(None, "mine"), key=KEYS[1]))  # another API key's id
    assert_unknown(post(ids_server, image_part(None, "mine"), cache_salt="other"))  # another salt's
    video = {"type": "video_url", "video_url": None, "uuid": "mine"}  # bound as an image
    assert post(ids_server, video).status_code == 400  # LLaVA takes no video: refused either way
    after = ids_server.metrics()
    assert delta(before, after, 'mmserve_mm_uuid_lookups_total{result="unknown"}') == 3
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0
    assert answer(ids_server, image_part(None, "mine"))  # the owner still has it


def test_a_uuid_sent_with_other_media_rebinds(ids_server: Server) -> None:
    first, second = make_image(502), make_image(503)
    first_answer = answer(ids_server, image_part(first))
    second_answer = answer(ids_server, image_part(second))
    assert first_answer != second_answer
    assert answer(ids_server, image_part(first, "photo")) == first_answer
    assert answer(ids_server, image_part(second, "photo")) == second_answer  # the media sent wins
    assert answer(ids_server, image_part(None, "photo")) == second_answer  # and is what the id names now


def test_an_item_only_the_encoder_cache_holds_is_served_from_it(ids_server: Server) -> None:
    image = make_image(504)
    expected = answer(ids_server, image_part(image, "encoded"))
    answer(ids_server, image_part(make_image(505)))  # evicts it from the processor and IPC caches
    before = ids_server.metrics()
    assert answer(ids_server, image_part(None, "encoded")) == expected
    after = ids_server.metrics()
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 0  # not from those caches
    assert delta(before, after, "mmserve_mm_ipc_cache_hits_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 0
    assert delta(before, after, 'mmserve_mm_uuid_lookups_total{result="hit"}') == 1


def test_an_item_evicted_from_every_cache_is_refused_then_served_again_when_resent(
    ids_server: Server,
) -> None:
    image = make_image(506)
    expected = answer(ids_server, image_part(image, "evicted"))
    for seed in range(600, 600 + ENCODER_CACHE_IMAGES + 1):  # past the encoder cache's room too
        answer(ids_server, image_part(make_image(seed)))
    before = ids_server.metrics()
    assert_unknown(post(ids_server, image_part(None, "evicted")), uuid="evicted")
    after = ids_server.metrics()
    assert delta(before, after, 'mmserve_mm_uuid_lookups_total{result="unknown"}') == 1
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0
    assert answer(ids_server, image_part(image, "evicted")) == expected
    assert answer(ids_server, image_part(None, "evicted")) == expected


def test_concurrent_binds_and_uses_of_one_uuid_answer_about_their_own_media(ids_server: Server) -> None:
    images = [make_image(510 + i) for i in range(4)]
    expected = [answer(ids_server, image_part(image)) for image in images]
    assert len(set(expected)) == len(expected)
    parts = [image_part(images[i % 4], "shared") for i in range(8)]
    parts += [image_part(None, "shared") for _ in range(4)]
    with ThreadPoolExecutor(len(parts)) as pool:
        responses = list(pool.map(lambda part: post(ids_server, part), parts))
    for i, resp in enumerate(responses[:8]):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == expected[i % 4]
    for resp in responses[8:]:  # whichever media the id named then, or none any more: never a mix-up
        if resp.status_code == 200:
            assert resp.json()["choices"][0]["message"]["content"] in expected
        else:
            assert_unknown(resp)


def test_bad_media_ids_name_their_field(ids_server: Server) -> None:
    cases = [
        ({"type": "image_url", "image_url": None, "uuid": 7}, "messages[0].content[0].uuid"),
        ({"type": "image_url", "image_url": None, "uuid": ""}, "messages[0].content[0].uuid"),
        ({"type": "image_url", "image_url": None, "uuid": "x" * 129}, "messages[0].content[0].uuid"),
        ({"type": "image_url", "image_url": None, "uuid": "tab\there"}, "messages[0].content[0].uuid"),
        ({"type": "image_url", "image_url": None}, "messages[0].content[0].image_url"),
        ({"type": "image_url"}, "messages[0].content[0].image_url"),
        ({"type": "text", "text": "hi", "uuid": "a"}, "messages[0].content[0].uuid"),
    ]
    for part, param in cases:
        resp = post(ids_server, part)
        assert resp.status_code == 400, (part, resp.text)
        assert resp.json()["error"]["param"] == param, (part, resp.json())
    for salt in ("", 5):
        resp = post(ids_server, image_part(make_image(520)), cache_salt=salt)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text


def cache_hits(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = ("mm_processor_cache", "mm_ipc_cache", "encoder_cache", "prefix_cache")
    return {name: delta(before, after, f"mmserve_{name}_hits_total") for name in names}


def assert_a_repeat_hit(before: dict[str, float], after: dict[str, float]) -> None:
    """Between the two scrapes, a request the same as one before it: every cache of the API and the
    prefix cache hit, and the prefix-cache hit holds the image whole, so the encoder cache is not even
    asked and nothing is encoded."""
    hits = cache_hits(before, after)
    assert hits.pop("encoder_cache") == 0 and all(n > 0 for n in hits.values()), hits
    assert delta(before, after, "mmserve_encoder_cache_queries_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 0


def test_salts_share_no_cache_hit_and_never_change_the_answer(ids_server: Server) -> None:
    image = make_image(530)
    first = post(ids_server, image_part(image), cache_salt="salt-a")
    assert first.status_code == 200, first.text
    before = ids_server.metrics()
    same = post(ids_server, image_part(image), cache_salt="salt-a")
    middle = ids_server.metrics()
    other = post(ids_server, image_part(image), cache_salt="salt-b")
    after = ids_server.metrics()
    texts = [resp.json()["choices"][0]["message"]["content"] for resp in (first, same, other)]
    assert texts[0] == texts[1] == texts[2]
    assert_a_repeat_hit(before, middle)
    assert same.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cache_hits(middle, after) == dict.fromkeys(cache_hits(middle, after), 0.0)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert delta(middle, after, "mmserve_encoder_runs_total") == 1


def test_tenant_isolation_keeps_each_keys_caches_apart(ids_server: Server) -> None:
    image = make_image(540)
    first = answer(ids_server, image_part(image))
    before = ids_server.metrics()
    assert answer(ids_server, image_part(image), key=KEYS[1]) == first
    middle = ids_server.metrics()
    assert answer(ids_server, image_part(image)) == first  # evicted from the one-item caches by then
    assert answer(ids_server, image_part(image)) == first
    after = ids_server.metrics()
    assert cache_hits(before, middle) == dict.fromkeys(cache_hits(before, middle), 0.0)
    assert delta(before, middle, "mmserve_encoder_runs_total") == 1
    assert_a_repeat_hit(middle, after)  # the first key's entries were kept
