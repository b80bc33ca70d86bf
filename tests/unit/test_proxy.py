"""``mmserve proxy`` without processes: which images a request carries, the encoder requests built for
them, round-robin, and the app itself in front of fake upstreams (an httpx transport in this process)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.launch.cli import build_parser
from app.proxy.cli import ProxyConfig, config_from_args
from app.proxy.forward import RoundRobin, encoder_body, forwarded_headers, media_parts
from app.proxy.server import create_proxy_app
from tests.e2e.metrics import parse_metrics

ENCODERS = ("http://enc-a", "http://enc-b")
LM = "http://lm"
COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"message": {"content": "hi"}}]}
SSE_EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def chat(*content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llava", "messages": [{"role": "user", "content": list(content)}], **extra}


# ---------------------------------------------------------------- pure helpers


def test_image_parts_are_distinct_by_url_in_first_appearance_order() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [image("u1"), {"type": "text", "text": "x"}, image("u2")]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [image("u2", detail="high"), image("u3"), image("u1")]},
        ]
    }
    assert [p["image_url"]["url"] for p in media_parts(body)] == ["u1", "u2", "u3"]
    assert "detail" not in media_parts(body)[1]["image_url"]  # the first part of a URL is the one sent


def test_videos_are_media_parts_too_distinct_by_kind_and_url() -> None:
    video = {"type": "video_url", "video_url": {"url": "u1"}}
    body = {"messages": [{"role": "user", "content": [video, image("u1"), dict(video), image("u2")]}]}
    assert [p["type"] for p in media_parts(body)] == ["video_url", "image_url", "image_url"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": "not a list"},
        {"messages": ["not a message", {"content": 7}]},
        # shapes mmserve refuses (app/api/schemas.py): the string form, a missing or non-string url
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}, "text"]}]},
    ],
)
def test_nothing_to_encode_in_requests_without_accepted_media_parts(body: dict[str, Any]) -> None:
    assert media_parts(body) == []


def test_encoder_body_keeps_what_the_content_hash_depends_on() -> None:
    original = chat(image("u1", detail="low"), {"type": "text", "text": "secret"}, temperature=0, stream=True)
    assert encoder_body(original, image("u1", detail="low")) == {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": [image("u1", detail="low")]}],
        "max_tokens": 1,
    }
    kwargs = {"size": {"shortest_edge": 336}}
    with_kwargs = encoder_body({**original, "mm_processor_kwargs": kwargs}, image("u1"))
    assert with_kwargs["mm_processor_kwargs"] == kwargs and "stream" not in with_kwargs
    salted = encoder_body({**original, "cache_salt": "tenant-a"}, image("u1"))
    assert salted["cache_salt"] == "tenant-a"  # the salt is in the mm_hash the LM looks up


def test_round_robin_cycles_in_order_and_drops_trailing_slashes() -> None:
    urls = RoundRobin(["http://a/", "http://b", "http://c"])
    assert [urls.next() for _ in range(7)] == ["http://a", "http://b", "http://c"] * 2 + ["http://a"]


def test_only_auth_content_type_and_request_id_are_forwarded() -> None:
    headers = httpx.Headers(
        {"Authorization": "Bearer k", "Content-Type": "application/json", "Cookie": "c", "X-Request-Id": "r"}
    )
    assert forwarded_headers(headers) == {
        "authorization": "Bearer k",
        "content-type": "application/json",
        "x-request-id": "r",
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"encoder_urls": ()}, "--encoder-url"),
        ({"lm_urls": ("127.0.0.1:8001",)}, "not an http"),
        ({"lm_urls": ("ftp://host",)}, "not an http"),
        ({"timeout_s": 0}, "--timeout"),
        ({"max_request_body_mb": -1}, "--max-request-body-mb"),
        ({"port": 70000}, "--port"),
    ],
)
def test_config_refuses_bad_values(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProxyConfig(**{"encoder_urls": ENCODERS, "lm_urls": (LM,), **change})


def test_cli_flags_build_the_config() -> None:
    argv = ["proxy", "--encoder-url", "http://127.0.0.1:1", "--encoder-url", "http://127.0.0.1:2"]
    argv += [
        "--lm-url",
        "http://127.0.0.1:3",
        "--port",
        "9",
        "--timeout",
        "2.5",
        "--max-request-body-mb",
        "1",
    ]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.encoder_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert config.lm_urls == ("http://127.0.0.1:3",) and config.host == "127.0.0.1"
    assert (config.port, config.timeout_s, config.max_request_body_bytes) == (9, 2.5, 1 << 20)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--encoder-url", "http://127.0.0.1:1"])  # no --lm-url


# ---------------------------------------------------------------- the app before fake upstreams


@dataclass
class FakeUpstreams:
    """Encoders and one LM behind one transport; records what each received. ``down``: hosts that
    refuse connections; ``failing``: hosts that answer 500."""

    received: list[httpx.Request] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    hangs_up: set[str] = field(default_factory=set)  # connected, then closed without an answer
    failing: set[str] = field(default_factory=set)
    slow: set[str] = field(default_factory=set)
    stream_breaks: bool = False  # the LM's SSE answer fails after its first event
    stream_closed: bool = False
    lm_status: int | None = None  # the LM answers every chat request with this status

    def to(self, host: str) -> list[httpx.Request]:
        return [r for r in self.received if r.url.host == host]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.received.append(request)
        if request.url.host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host in self.hangs_up:
            raise httpx.RemoteProtocolError("Server disconnected without a response.", request=request)
        if request.url.host in self.slow:
            await asyncio.sleep(30)
        if request.url.path == "/health":
            return httpx.Response(500 if request.url.host in self.failing else 200, json={"status": "ok"})
        if request.url.host in self.failing:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if request.url.host == "lm" and self.lm_status is not None:
            return httpx.Response(self.lm_status, json={"error": {"message": "odd"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-llava"}]})
        try:
            body = json.loads(request.content)
        except ValueError:
            return httpx.Response(400, json={"error": {"code": "invalid_json"}})
        if isinstance(body, dict) and body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=self._events())
        return httpx.Response(200, json=COMPLETION)

    def _events(self) -> httpx.AsyncByteStream:
        upstreams = self

        class Events(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                for event in SSE_EVENTS:
                    yield event
                    if upstreams.stream_breaks:
                        raise httpx.RemoteProtocolError("peer closed connection")

            async def aclose(self) -> None:
                upstreams.stream_closed = True

        return Events()


@pytest.fixture
def upstreams() -> FakeUpstreams:
    return FakeUpstreams()


@pytest.fixture
def proxy(upstreams: FakeUpstreams) -> Iterator[TestClient]:
    config = ProxyConfig(encoder_urls=ENCODERS, lm_urls=(LM,), timeout_s=1, max_request_body_mb=0.01)
    app = create_proxy_app(config, transport=httpx.MockTransport(upstreams.handle))
    with TestClient(app) as client:
        yield client


def metrics(proxy: TestClient) -> dict[str, float]:
    return parse_metrics(proxy.get("/metrics").text)


def test_each_distinct_image_goes_to_an_encoder_then_the_original_body_to_the_lm(
    proxy: TestClient, upstreams: FakeUpstreams
) -> None:
    raw = json.dumps(chat(image("u1"), image("u2"), image("u1"), {"type": "text", "text": "hi"})).encode()
    auth = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    resp = proxy.post("/v1/chat/completions", content=raw, headers=auth)
    assert resp.status_code == 200 and resp.json() == COMPLETION
    encoded = [
        json.loads(r.content)["messages"][0]["content"][0]["image_url"]["url"] for r in upstreams.received[:2]
    ]
    assert sorted(encoded) == ["u1", "u2"]
    assert len(upstreams.to("enc-a")) == len(upstreams.to("enc-b")) == 1  # round-robin over encoders
    (to_lm,) = upstreams.to("lm")
    assert upstreams.received[-1] is to_lm, "the LM is asked only after the encoders answered"
    assert to_lm.content == raw, "the original body, byte for byte"
    assert all(r.headers["authorization"] == "Bearer k" for r in upstreams.received)
    figures = metrics(proxy)
    assert figures["mmserve_proxy_requests_total"] == 1
    assert figures["mmserve_proxy_encoder_requests_total"] == 2
    assert figures["mmserve_proxy_encoder_failures_total"] == 0
    assert figures["mmserve_proxy_encoder_seconds_count"] == 1


def test_text_only_and_invalid_json_skip_the_encoders(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    assert proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"})).status_code == 200
    resp = proxy.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json() == {"error": {"code": "invalid_json"}}
    assert [r.url.host for r in upstreams.received] == ["lm", "lm"]
    assert upstreams.received[-1].content == b"{not json"
    assert metrics(proxy)["mmserve_proxy_encoder_seconds_count"] == 0


@pytest.mark.parametrize(
    "extra",
    [{"temperature": "hot"}, {"max_tokens": -1}, {"stream_options": {"include_usge": True}}, {"n": 0}],
)
def test_a_request_the_lm_refuses_by_its_schema_is_not_encoded(
    proxy: TestClient, upstreams: FakeUpstreams, extra: dict[str, Any]
) -> None:
    raw = json.dumps(chat(image("u1"), {"type": "text", "text": "hi"}, **extra)).encode()
    proxy.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert [r.url.host for r in upstreams.received] == ["lm"], "straight to the LM, which refuses it"
    assert upstreams.received[0].content == raw
    assert metrics(proxy)["mmserve_proxy_encoder_requests_total"] == 0


def test_encoder_failures_are_counted_and_the_lm_still_answers(
    proxy: TestClient, upstreams: FakeUpstreams
) -> None:
    upstreams.down.add("enc-a")
    upstreams.failing.add("enc-b")
    resp = proxy.post("/v1/chat/completions", json=chat(image("u1"), image("u2"), image("u3")))
    assert resp.status_code == 200 and resp.json() == COMPLETION
    assert metrics(proxy)["mmserve_proxy_encoder_failures_total"] == 3


def test_an_unreachable_lm_is_a_503_envelope(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    upstreams.down.add("lm")
    resp = proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}))
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "upstream_unavailable" and error["type"] == "server_error"
    assert error["param"] is None and "http://lm" in error["message"] and "unreachable" in error["message"]
    assert proxy.get("/v1/models").status_code == 503
    assert metrics(proxy)["mmserve_proxy_upstream_errors_total"] == 2


def test_an_lm_that_hangs_up_before_answering_is_a_503_saying_so(
    proxy: TestClient, upstreams: FakeUpstreams
) -> None:
    upstreams.hangs_up.add("lm")
    resp = proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "upstream_unavailable"
    message = resp.json()["error"]["message"]
    assert "closed the connection without answering" in message and "unreachable" not in message


def test_lm_errors_are_relayed_with_their_status(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    upstreams.failing.add("lm")
    resp = proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}))
    assert resp.status_code == 500 and resp.json() == {"error": {"message": "boom"}}


def test_an_lm_status_http_has_no_name_for_is_a_503(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    """uvicorn cannot send a status it has no reason phrase for (999): relayed as is, the client's
    connection was dropped without an answer."""
    upstreams.lm_status = 999
    resp = proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "upstream_unavailable"
    assert "999" in resp.json()["error"]["message"]


def test_a_stream_is_passed_through_and_closed(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    with proxy.stream("POST", "/v1/chat/completions", json=chat(image("u1"), stream=True)) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.read() == b"".join(SSE_EVENTS)
    assert upstreams.stream_closed


def test_a_body_over_the_cap_is_a_413_envelope(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    resp = proxy.post("/v1/chat/completions", json=chat({"type": "text", "text": "x" * 20_000}))
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert upstreams.received == []


def test_models_health_and_unknown_routes(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    assert proxy.get("/v1/models").json()["data"] == [{"id": "tiny-llava"}]
    assert proxy.get("/health").json() == {"status": "ok"}
    upstreams.down.add("enc-b")
    upstreams.failing.add("lm")
    resp = proxy.get("/health")
    assert resp.status_code == 503
    assert [(d["role"], d["url"]) for d in resp.json()["down"]] == [("lm", LM), ("encoder", "http://enc-b")]
    assert proxy.get("/nope").json()["error"]["type"] == "invalid_request_error"


def test_a_slow_encoder_is_given_up_after_the_timeout(proxy: TestClient, upstreams: FakeUpstreams) -> None:
    upstreams.slow.add("enc-a")
    start = time.monotonic()
    resp = proxy.post("/v1/chat/completions", json=chat(image("u1"), image("u2")))
    assert resp.status_code == 200 and time.monotonic() - start < 5
    assert metrics(proxy)["mmserve_proxy_encoder_failures_total"] == 1  # enc-b answered its image


def test_an_lm_failing_mid_stream_ends_it_with_an_error_event(
    proxy: TestClient, upstreams: FakeUpstreams
) -> None:
    upstreams.stream_breaks = True
    with proxy.stream("POST", "/v1/chat/completions", json=chat(image("u1"), stream=True)) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200 and events[0] == SSE_EVENTS[0].decode().strip()
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "upstream_unavailable"
    assert len(events) == 2 and upstreams.stream_closed
    assert metrics(proxy)["mmserve_proxy_upstream_errors_total"] == 1
