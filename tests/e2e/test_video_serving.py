"""Video end to end on the three Qwen families (tiny checkpoints): greedy output equals transformers'
``generate`` on what the checkpoint's own HF processor makes of the same clip (tests/reference: the
frames HF's ``sample_frames`` picks, its video processor's tensors, its prompt with Qwen3-VL's
timestamps, Qwen2.5-VL's ``second_per_grid_ts``) — a clip sampled by fps, the same by num_frames, two
clips in one prompt, a clip beside an image; cold, again from every cache (no encoder run), in 128-token
prefill chunks through the clip, and with every cache off; ``usage.prompt_tokens`` is the processor's.
Two samplings of one clip are two cache entries; the same bytes by URL or data URL are one."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Oracle, make_image
from tests.e2e.metrics import delta
from tests.e2e.parity import assert_matches_greedy
from tests.e2e.server import Server
from tests.e2e.video_oracle import Case, Expected, body, expected_answers
from tests.video_clips import make_clip

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
CHUNKED = ("--max-num-batched-tokens", "128")  # shared with tests/e2e/test_qwen_serving.py
OFF = (
    "--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--encoder-cache-tokens", "0",
    "--no-enable-prefix-caching",
)  # fmt: skip

CLIP_A = make_clip(width=160, height=120, fps=10, num_frames=40, seed=1)  # H.264 in MP4, 4 s
CLIP_B = make_clip(width=96, height=80, fps=8, num_frames=24, seed=2, codec="vp9", container="webm")  # 3 s
IMAGE = make_image(870, (224, 224))


CASES = {
    "fps": Case("What happens in the clip?", (CLIP_A,), {"fps": 2}),
    "num_frames": Case("What happens in the clip?", (CLIP_A,), {"num_frames": 6}),
    "two_clips": Case("Compare the two clips.", (CLIP_A, CLIP_B), {"fps": 2}),
    "clip_and_image": Case("Is the picture in the clip?", (IMAGE, CLIP_A), {"fps": 1}),
}


def post(server: Server, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=300)


def ask(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    resp = post(server, payload)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def expected(
    tiny_model: Callable[[str], Path], family_oracle: Callable[[str], Oracle]
) -> dict[tuple[str, str], Expected]:
    """Every family's answer to every case (two batched reference calls, then ``generate``)."""
    cases = {(family, name): (family, case) for family in FAMILIES for name, case in CASES.items()}
    return expected_answers(cases, tiny_model, family_oracle)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_generate_cold_from_every_cache_chunked_and_uncached(
    family: str,
    name: str,
    expected: dict[tuple[str, str], Expected],
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
) -> None:
    case, want = CASES[name], expected[family, name]
    tokenizer = family_oracle(family).processor.tokenizer
    server = family_server(family)
    num_videos = sum(isinstance(m, bytes) for m in case.media)
    before = server.metrics()
    cold = ask(server, body(case, family))
    assert_matches_greedy(cold, tokenizer, want.ids, want.logprobs)
    assert cold["usage"]["prompt_tokens"] == want.num_prompt_tokens

    warm_before = server.metrics()
    warm = ask(server, body(case, family))
    warm_after = server.metrics()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert delta(warm_before, warm_after, "mmserve_encoder_runs_total") == 0
    assert delta(warm_before, warm_after, "mmserve_mm_processor_cache_hits_total") == len(case.media)
    assert delta(warm_before, warm_after, "mmserve_mm_ipc_cache_hits_total") == len(case.media)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= want.num_prompt_tokens - 16
    assert delta(before, warm_after, "mmserve_mm_items_total") == 2 * len(case.media)
    assert num_videos > 0

    for flags in (CHUNKED, OFF):  # prefill chunks through the clip; no cache at all
        assert_matches_greedy(
            ask(family_server(family, *flags), body(case, family)), tokenizer, want.ids, want.logprobs
        )


def test_two_samplings_of_one_clip_are_two_entries(family_server: Callable[..., Server]) -> None:
    server = family_server("qwen2_5_vl")
    first = Case("Sampled how?", (CLIP_B,), {"fps": 1.5})  # samplings no other test asks for
    before = server.metrics()
    one = ask(server, body(first, "qwen2_5_vl", n=2))
    other = ask(server, body(Case(first.text, first.media, {"fps": 3}), "qwen2_5_vl", n=2))
    again = ask(server, body(first, "qwen2_5_vl", n=2))
    after = server.metrics()
    assert delta(before, after, "mmserve_encoder_runs_total") == 2  # fps 1.5, fps 3; 1.5 again is cached
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 1
    assert other["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def clip_http_server() -> Iterator[str]:
    """A loopback HTTP server: /a.mp4 is CLIP_A; /huge.mp4 claims 300 MB and sends nothing."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/huge.mp4":
                self.send_response(200)
                self.send_header("Content-Type", "video/mp4")
                self.send_header("Content-Length", str(300 << 20))
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(CLIP_A)))
            self.end_headers()
            self.wfile.write(CLIP_A)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_the_same_bytes_by_url_and_data_url_are_one_entry(
    family_server: Callable[..., Server], clip_http_server: str
) -> None:
    server = family_server("qwen3_vl")
    case = Case("One entry?", (CLIP_A,), {"fps": 1})
    by_data = ask(server, body(case, "qwen3_vl", n=2))
    by_url = body(case, "qwen3_vl", n=2)
    by_url["messages"][0]["content"][0]["video_url"]["url"] = f"{clip_http_server}/a.mp4"
    before = server.metrics()
    assert ask(server, by_url)["choices"][0]["message"] == by_data["choices"][0]["message"]
    after = server.metrics()
    assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == 1
    assert delta(before, after, "mmserve_encoder_runs_total") == 0


def test_videos_through_the_shm_ring_and_past_its_object_size(
    expected: dict[tuple[str, str], Expected],
    family_server: Callable[..., Server],
    family_oracle: Callable[[str], Oracle],
) -> None:
    """At fps 2 CLIP_B's tensors (3.9 MiB) go through the ring; CLIP_A's (5.0 MiB) are over the ring's
    object size and take the normal path; the answers are the cold run's, and a repeat runs no encoder."""
    family, case, want = "qwen2_5_vl", CASES["two_clips"], expected["qwen2_5_vl", "two_clips"]
    tokenizer = family_oracle(family).processor.tokenizer
    server = family_server(
        family, "--mm-processor-cache-type", "shm", "--mm-shm-cache-max-object-size-mb", "4.5"
    )
    before = server.metrics()
    assert_matches_greedy(ask(server, body(case, family)), tokenizer, want.ids, want.logprobs)
    cold = server.metrics()
    assert 3.5 * 2**20 < delta(before, cold, "mmserve_mm_shm_bytes_total") < 5 * 2**20  # CLIP_B only
    assert_matches_greedy(ask(server, body(case, family)), tokenizer, want.ids, want.logprobs)
    warm = server.metrics()
    assert delta(cold, warm, "mmserve_encoder_runs_total") == 0
    assert delta(cold, warm, "mmserve_mm_shm_bytes_total") == 0
