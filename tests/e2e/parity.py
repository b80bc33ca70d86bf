"""Comparing served greedy output with transformers' ``generate`` (the correctness oracle)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.e2e.conftest import Oracle, greedy_body, user_message
from tests.e2e.server import Server, role_pid
from tests.near_tie import accept_near_tie, first_divergence
from tests.paused import paused

NUM_TOKENS = 32
# a divergence is accepted only if the served token is the oracle's runner-up this close (tests/near_tie.py)
NEAR_TIE = 1e-3


def greedy_request(
    server: Server, text: str, images: list[Any], n: int = NUM_TOKENS, **extra: Any
) -> dict[str, Any]:
    body = greedy_body([user_message(text, *images)], n, logprobs=True, top_logprobs=2, **extra)
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def concurrent_greedy_requests(
    server: Server, cases: list[tuple[str, list[Any]]], **extra: Any
) -> list[dict[str, Any]]:
    """Every ``(text, images)`` case sent at once, as ``greedy_request`` sends one, and taken by the engine
    in one go (``taken_together``); responses in order."""
    bodies = [
        greedy_body([user_message(text, *images)], NUM_TOKENS, logprobs=True, top_logprobs=2, **extra)
        for text, images in cases
    ]
    return taken_together(server, bodies)


def concurrent_bodies(server: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every request body sent at once; the responses in order (each must succeed)."""

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:

            async def one(body: dict[str, Any]) -> dict[str, Any]:
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                return dict(resp.json())

            return list(await asyncio.gather(*(one(body) for body in bodies)))

    return asyncio.run(run())


def taken_together(server: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``concurrent_bodies`` with the worker paused until the API has handed every request to the engine,
    which then takes them in one go: however slowly the API prepares them, no request is done before the
    last arrives (a preemption test would otherwise see none)."""
    assert server.process.proc is not None
    worker = role_pid(server.process.proc.pid, "worker")
    sent = server.metrics()["mmserve_engine_requests_sent_total"]
    choices = sum(int(body.get("n", 1)) for body in bodies)
    with ThreadPoolExecutor(1) as pool:
        with paused(worker):
            answers = pool.submit(concurrent_bodies, server, bodies)
            deadline = time.monotonic() + 120
            while server.metrics()["mmserve_engine_requests_sent_total"] - sent < choices:
                assert not answers.done(), answers.result()
                assert time.monotonic() < deadline, "the API never sent them all"
                time.sleep(0.02)
        return answers.result()


def assert_matches_oracle(response: dict[str, Any], oracle: Oracle, text: str, images: list[Any]) -> None:
    hf_ids, hf_logprobs = oracle.greedy(text, images, NUM_TOKENS)
    assert_matches_greedy(response, oracle.processor.tokenizer, hf_ids, hf_logprobs)


def assert_matches_greedy(
    response: dict[str, Any],
    tokenizer: Any,
    hf_ids: list[int],
    hf_logprobs: Any,
    bound: float = NEAR_TIE,
    quantized: bool = False,
) -> None:
    """The served tokens are the oracle's ``hf_ids`` (compared as the text of each token, which is what
    the API returns), but for a divergence at a true near-tie: the served token is the oracle's runner-up
    with a logprob gap under ``bound`` (tests/near_tie.py, the rule of every tier; ``quantized``: the
    oracle's logits are bf16). The comparison stops there by design: after it, the two answers continue
    different prefixes."""
    served = [entry["token"] for entry in response["choices"][0]["logprobs"]["content"]]
    assert len(served) == len(hf_ids) == response["usage"]["completion_tokens"]

    def spell(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    pos = first_divergence(served, [spell(token_id) for token_id in hf_ids])
    if pos is not None:
        accept_near_tie(pos, served[pos], hf_ids[pos], hf_logprobs[pos], bound, spell, quantized)
        return
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(hf_ids, skip_special_tokens=True)
