"""``POST /tokenize`` counts what a chat request with the same messages would send — images and videos
at the model's own placeholder counts, on every family — through the processor cache (the chat
request that follows is a hit, under the same ``cache_salt`` only), under the same media policy, media
limits and auth; ``POST /detokenize`` reverses a prompt's ids."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import AUTH, data_url, make_image, png_bytes
from tests.e2e.held_image import held_image
from tests.e2e.metrics import delta
from tests.e2e.server import Server
from tests.e2e.video_oracle import video_url
from tests.video_clips import make_clip

pytestmark = pytest.mark.slow

FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
CLIP = make_clip(width=96, height=80, fps=8, num_frames=24, seed=3)


def image(seed: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (200, 150)))}}


def video() -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": video_url(CLIP)}}


def text(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


# (media parts, mm_processor_kwargs); videos only for the Qwen families
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "image": ([image(7301)], {}),
    "two_images": ([image(7302), image(7303)], {}),
    "video_fps": ([video()], {"fps": 2}),
    "video_num_frames": ([video()], {"num_frames": 4}),
    "video_and_image": ([image(7304), video()], {"fps": 1}),
}


def post(server: Server, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_count_is_the_chat_requests_prompt_tokens(
    family_server: Callable[..., Server], family: str, case: str
) -> None:
    if family == "llava" and "video" in case:
        pytest.skip("LLaVA-1.5 takes no video")
    server = family_server(family)
    parts, kwargs = CASES[case]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*parts, text(f"What is in the {case}?")]},
    ]
    extra = {"mm_processor_kwargs": kwargs} if kwargs else {}
    before = server.metrics()
    counted = post(server, "/tokenize", {"model": f"tiny-{family}", "messages": messages, **extra})
    assert counted.status_code == 200, counted.text
    tokenized = counted.json()
    chat_body = {"model": f"tiny-{family}", "messages": messages, "max_tokens": 1, **extra}
    chat = post(server, "/v1/chat/completions", chat_body)
    assert chat.status_code == 200, chat.text
    after = server.metrics()
    assert tokenized["count"] == len(tokenized["tokens"]) == chat.json()["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] > tokenized["count"] > 20 * len(parts)  # real placeholder counts
    assert tokenized["token_strs"] is None
    # each item processed once, by /tokenize: the chat request found it in the processor cache
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == len(parts)


def test_a_prompt_is_tokenized_as_text_and_detokenizes_back(server: Server) -> None:
    prompt = "Hello there, what is a picture?"
    plain = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    special = post(server, "/tokenize", {"model": "tiny-llava", "prompt": prompt, "return_token_strs": True})
    assert special.status_code == 200, special.text
    with_bos = special.json()
    assert with_bos["tokens"][1:] == plain["tokens"] and with_bos["count"] == plain["count"] + 1
    assert len(with_bos["token_strs"]) == with_bos["count"]
    back = post(server, "/detokenize", {"model": "tiny-llava", "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_template_options_change_the_count(server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    opened = post(server, "/tokenize", {"messages": messages}).json()["count"]
    continued = post(
        server,
        "/tokenize",
        {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    ).json()["count"]
    assert continued < opened
    defaults = {"add_generation_prompt": None, "continue_final_message": None, "return_token_strs": None}
    assert post(server, "/tokenize", {"messages": messages, **defaults}).json()["count"] == opened  # as chat
    # an assistant's refusal is what it said
    refused = [messages[0], {"role": "assistant", "content": None, "refusal": "Hello, I am"}]
    assert post(server, "/tokenize", {"messages": refused}).json()["count"] == opened
    as_part = [messages[0], {"role": "assistant", "content": [{"type": "refusal", "refusal": "Hello, I am"}]}]
    assert post(server, "/tokenize", {"messages": as_part}).json()["count"] == opened
    not_said = [messages[0], {"role": "assistant", "content": [{"type": "refusal", "refusal": 7}]}]
    assert post(server, "/tokenize", {"messages": not_said}).json()["error"]["param"] == "messages[1].content"
    by_user = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert post(server, "/tokenize", {"messages": by_user}).status_code == 400


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
        ({}, 400, None),
        ({"model": "other", "prompt": "a"}, 404, None),
        ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400, None),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400, None),
        (  # LLaVA's template renders no tools
            {
                "messages": [{"role": "user", "content": "a"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": [image(7305)]}], "mm_processor_kwargs": {"x": 1}},
            400,
            None,
        ),
        # what only the messages form reads is refused beside a prompt, by name
        ({"prompt": "a", "mm_processor_kwargs": {"bogus": 1}}, 400, "mm_processor_kwargs"),
        ({"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"prompt": "a", "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ({"prompt": "a", "chat_template_kwargs": {"enable_thinking": True}}, 400, "chat_template_kwargs"),
    ],
)
def test_bad_bodies_are_openai_errors(
    server: Server, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = post(server, "/tokenize", body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    if param is not None:
        assert error["param"] == param, error


def test_an_unknown_field_is_taken_and_logged_as_on_chat(server: Server) -> None:
    resp = post(server, "/tokenize", {"prompt": "a", "tokenize_frobnicate": 1})
    assert resp.status_code == 200, resp.text
    assert "does not know were ignored: ['tokenize_frobnicate']" in server.process.log()


def test_a_long_prompt_is_tokenized_off_the_event_loop(server: Server) -> None:
    """Megabytes of text take the tokenizer seconds: meanwhile the API process answers others, as it
    does for a chat request's long prompt (tests/e2e/test_bad_input.py)."""
    long = {"prompt": "hello world " * 700_000}  # 8.4 MB
    finished: dict[str, Any] = {}

    def send_long() -> None:
        resp = post(server, "/tokenize", long)
        finished["long"] = time.monotonic()
        finished["status"] = resp.status_code

    sender = threading.Thread(target=send_long)
    sender.start()
    time.sleep(1.0)  # sent and read; now being tokenized
    asked = time.monotonic()
    health = httpx.get(f"{server.base_url}/health", timeout=60)
    answered_first = "long" not in finished  # not when the tokenizer was done (seconds later)
    sender.join(120)
    assert health.status_code == 200 and finished["status"] == 200
    assert answered_first, (
        f"/health waited for the tokenizer ({finished['long'] - asked:.2f} s after it was asked)"
    )


def test_detokenize_refuses_ids_outside_the_vocabulary(server: Server) -> None:
    resp = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"


def test_media_policy_and_auth_apply(uncached_server: Server, guarded_server: Server) -> None:
    """The uncached server fetches from one domain only; the guarded one wants its key."""
    url_part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    messages = [{"role": "user", "content": [url_part, text("What?")]}]
    refused = post(uncached_server, "/tokenize", {"messages": messages})
    chat = post(uncached_server, "/v1/chat/completions", {"model": "tiny-llava", "messages": messages})
    assert refused.status_code == chat.status_code == 400
    assert refused.json()["error"]["code"] == chat.json()["error"]["code"]
    assert post(guarded_server, "/tokenize", {"prompt": "a"}).status_code == 401
    assert post(guarded_server, "/tokenize", {"prompt": "a"}, headers=AUTH).status_code == 200


def test_a_salted_count_is_a_processor_cache_hit_for_its_salt_only(server: Server) -> None:
    """/tokenize under a ``cache_salt`` processes the image into that salt's entry: a chat request with
    another salt, or with none, processes it again; one with the same salt finds it."""
    messages = [{"role": "user", "content": [image(7311), text("Salted?")]}]
    chat = {"model": "tiny-llava", "messages": messages, "max_tokens": 1}
    readings = [server.metrics()]
    counted = post(server, "/tokenize", {"messages": messages, "cache_salt": "salt-a"})
    assert counted.status_code == 200, counted.text
    readings.append(server.metrics())
    for salt in ("salt-b", None, "salt-a"):
        resp = post(server, "/v1/chat/completions", chat if salt is None else {**chat, "cache_salt": salt})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == counted.json()["count"]
        readings.append(server.metrics())
    steps = list(pairwise(readings))  # /tokenize salt-a, then chat salt-b, unsalted, salt-a
    assert [delta(a, b, "mmserve_mm_processor_cache_hits_total") for a, b in steps] == [0, 0, 0, 1]
    assert [delta(a, b, "mmserve_mm_processor_seconds_count") for a, b in steps] == [1, 1, 1, 0]


def test_more_media_than_the_limit_is_the_chat_requests_400_before_anything_is_fetched(
    family_server: Callable[..., Server],
) -> None:
    """One image over the default limit (999) or one video over it (4): /tokenize answers the error the
    chat request answers, having fetched (from a server that would hold its answer) and processed nothing."""
    server = family_server("qwen2_5_vl")
    with held_image(png_bytes(make_image(1)), hold_s=60) as (held, asked, _):
        too_many = {
            "image=999": [{"type": "image_url", "image_url": {"url": held}}] * 1000,
            "video=4": [{"type": "video_url", "video_url": {"url": held}}] * 5,
        }
        for limit, parts in too_many.items():
            messages = [{"role": "user", "content": [*parts, text("So many?")]}]
            before = server.metrics()
            counted = post(server, "/tokenize", {"messages": messages})
            chat = post(server, "/v1/chat/completions", {"model": "tiny-qwen2_5_vl", "messages": messages})
            assert not asked.is_set(), limit
            assert counted.status_code == chat.status_code == 400, counted.text
            error = counted.json()["error"]
            assert error == chat.json()["error"]
            assert error["code"] == "mm_limit_exceeded" and error["param"] == "messages", error
            assert f"--limit-mm-per-prompt {limit}" in error["message"], error
            assert delta(before, server.metrics(), "mmserve_mm_items_total") == 0
