"""``n`` choices on the tiny LLaVA: the prompt and its image are processed once, encoded once and
prefilled once (the other choices find its blocks in the prefix cache and recompute only the block the
prompt ends in); each choice samples on its own, a seeded request reproducibly; streamed choices
reassemble by ``index`` to the non-streamed answer; usage counts the prompt once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import Server, serving, stream_chunks

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the server's --block-size (the default)
PROCESSOR_RUNS = "mmserve_mm_processor_seconds_count"


def post(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def sampled_body(seed_image: int, n: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llava",
        "messages": [user_message("Describe the picture in detail.", make_image(seed_image))],
        "max_tokens": 12,
        "temperature": 1.0,
        "ignore_eos": True,
        "n": n,
        **extra,
    }


def texts(response: dict[str, Any]) -> list[str]:
    choices = response["choices"]
    assert [choice["index"] for choice in choices] == list(range(len(choices)))
    return [choice["message"]["content"] for choice in choices]


def test_four_choices_prepare_encode_and_prefill_the_prompt_once(server: Server) -> None:
    before = server.metrics()
    response = post(server, sampled_body(9101, 4))
    after = server.metrics()
    assert len(texts(response)) == 4 and len(set(texts(response))) > 1  # sampled on their own
    assert all(choice["finish_reason"] == "length" for choice in response["choices"])
    usage = response["usage"]
    num_prompt = usage["prompt_tokens"]
    assert usage["completion_tokens"] == 4 * 12 and usage["total_tokens"] == num_prompt + 48
    assert delta(before, after, PROCESSOR_RUNS) == 1
    assert delta(before, after, "mmserve_encoder_runs_total") == 1
    # Choices 1-3 each look the prompt up and find at least every full block but the one holding its last
    # token (at most every token but the last); choice 0 at most the chat template's first tokens, from
    # earlier requests.
    assert delta(before, after, "mmserve_prefix_cache_queries_total") == 4 * num_prompt
    hit_per_choice = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    hits = delta(before, after, "mmserve_prefix_cache_hits_total")
    assert 3 * hit_per_choice <= hits < 3 * (num_prompt - 1) + BLOCK_SIZE
    assert num_prompt - hit_per_choice <= BLOCK_SIZE  # so the prompt was computed once, and 3 tails


def test_a_seeded_request_repeats_its_choices_and_each_choice_has_its_own_stream(server: Server) -> None:
    first = texts(post(server, sampled_body(9102, 4, seed=77)))
    again = texts(post(server, sampled_body(9102, 4, seed=77)))
    assert first == again
    assert len(set(first)) == 4
    # choice i is seeded with seed + i: choice 0 of seed 78 is choice 1 of seed 77
    assert texts(post(server, sampled_body(9102, 1, seed=78)))[0] == first[1]


def test_greedy_choices_are_identical(server: Server) -> None:
    body = sampled_body(9103, 3, temperature=0)
    choices = texts(post(server, body))
    assert choices == [texts(post(server, {**body, "n": 1}))[0]] * 3


def test_streamed_choices_reassemble_by_index_with_logprobs_and_usage(server: Server) -> None:
    body = sampled_body(9104, 3, seed=5, logprobs=True, top_logprobs=2)
    whole = post(server, body)
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    parts: dict[int, str] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {}
    finish: dict[int, str] = {}
    usage = None
    ids: set[str] = set()
    for event in stream_chunks(server, {**body, **streamed}):
        ids.add(event["id"])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            index = choice["index"]
            parts[index] = parts.get(index, "") + choice["delta"].get("content", "")
            logprobs.setdefault(index, []).extend((choice.get("logprobs") or {}).get("content") or [])
            if choice["finish_reason"] is not None:
                finish[index] = choice["finish_reason"]
    assert len(ids) == 1  # one response, its choices interleaved
    assert [parts[i] for i in range(3)] == texts(whole)
    assert finish == {0: "length", 1: "length", 2: "length"}
    for i, choice in enumerate(whole["choices"]):
        assert [e["token"] for e in logprobs[i]] == [e["token"] for e in choice["logprobs"]["content"]]
        assert len(choice["logprobs"]["content"]) == 12
        assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    assert usage is not None and usage["completion_tokens"] == 36
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_stop_strings_end_each_choice_on_its_own(server: Server) -> None:
    """A stop string found in one choice ends that choice only; the others run to their length."""
    body = sampled_body(9105, 4, seed=11, max_tokens=24)
    free = texts(post(server, body))
    # a stop string taken from the middle of choice 0's answer
    stop = free[0][len(free[0]) // 2 :][:3]
    assert stop.strip()
    stopped = post(server, {**body, "stop": [stop]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert texts(stopped)[0] == free[0][: free[0].index(stop)]
    for before, choice in zip(free[1:], stopped["choices"][1:], strict=True):
        if stop in before:
            assert choice["message"]["content"] == before[: before.index(stop)]
        else:
            assert (choice["message"]["content"], choice["finish_reason"]) == (before, "length")


def test_request_id_names_the_response(server: Server) -> None:
    body = sampled_body(9106, 2, request_id="my-trace-42", max_tokens=2)
    assert post(server, body)["id"] == "chatcmpl-my-trace-42"
    # the X-Request-Id header over the body's, as vLLM reads them; on completions too
    chat, completions = f"{server.base_url}/v1/chat/completions", f"{server.base_url}/v1/completions"
    headed = httpx.post(chat, json=body, headers={"X-Request-Id": "hdr-7"}, timeout=60)
    assert headed.status_code == 200 and headed.json()["id"] == "chatcmpl-hdr-7"
    prompt = {"model": "tiny-llava", "prompt": "Hi", "max_tokens": 2, "request_id": "b-1"}
    assert httpx.post(completions, json=prompt, timeout=60).json()["id"] == "cmpl-b-1"
    headed = httpx.post(completions, json=prompt, headers={"X-Request-Id": "hdr-8"}, timeout=60)
    assert headed.json()["id"] == "cmpl-hdr-8"
    sent = server.metrics()["mmserve_engine_requests_sent_total"]
    for url, sent_body in ((chat, body), (completions, prompt)):
        refused = httpx.post(url, json=sent_body, headers={"X-Request-Id": "x" * 129}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "x-request-id"
    assert server.metrics()["mmserve_engine_requests_sent_total"] == sent  # refused before any work


LEAK_TOKENS = 3000  # a choice the client left that ran on would take about 3 s (idle)


@pytest.fixture(scope="module")
def two_seqs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two requests run at once, two may wait."""
    flags = ("--max-waiting-requests", "2", "--max-num-seqs", "2")
    with serving(tiny_model_dir, tmp_path_factory.mktemp("two-seqs"), *flags) as server:
        yield server


def test_more_choices_than_the_waiting_cap_run_as_one_request(two_seqs: Server) -> None:
    """``--max-waiting-requests`` admits or refuses a request as a whole: on an idle server ``n`` above
    it is answered (its later choices were once 429s that no retry could cure)."""
    answer = post(two_seqs, sampled_body(41, 6, seed=5))
    assert sorted(choice["index"] for choice in answer["choices"]) == list(range(6))
    assert answer["usage"]["completion_tokens"] == 6 * 12


def test_a_client_gone_while_its_later_choices_start_aborts_every_choice(two_seqs: Server) -> None:
    """Choices 0 and 1 run (two at a time), choice 2 waits for a slot: the stream has not started when
    the client gives up, and every choice is aborted, the running ones included."""
    body = sampled_body(42, 3, max_tokens=LEAK_TOKENS, stream=True)
    url = f"{two_seqs.base_url}/v1/chat/completions"
    steps = two_seqs.metrics()["mmserve_engine_steps_total"]
    with pytest.raises(httpx.TimeoutException), httpx.stream("POST", url, json=body, timeout=1.0) as r:
        r.read()
    deadline = time.monotonic() + 60
    while (metrics := two_seqs.metrics())["mmserve_num_requests_running"] > 0:
        assert time.monotonic() < deadline, "a choice still runs for a client that left"
        time.sleep(0.1)
    # counted in steps, not seconds (a loaded machine is slow at both): a choice that ran on would have
    # taken one step per token, all of its max_tokens
    assert metrics["mmserve_engine_steps_total"] - steps < LEAK_TOKENS, (
        "a choice ran on for a client that left"
    )
    assert metrics["mmserve_num_requests_waiting"] == 0 and metrics["mmserve_kv_cache_usage_ratio"] == 0
