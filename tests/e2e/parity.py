"""Comparing served greedy output with transformers' ``generate`` (the correctness oracle)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.e2e.conftest import Oracle, greedy_body, user_message
from tests.e2e.server import Server

NUM_TOKENS = 32
NEAR_TIE = 1e-3  # a divergence is accepted only where the oracle's top-2 logprobs are this close


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
    """Every ``(text, images)`` case sent at once, as ``greedy_request`` sends one; responses in order."""
    bodies = [
        greedy_body([user_message(text, *images)], NUM_TOKENS, logprobs=True, top_logprobs=2, **extra)
        for text, images in cases
    ]
    return concurrent_bodies(server, bodies)


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


def assert_matches_oracle(response: dict[str, Any], oracle: Oracle, text: str, images: list[Any]) -> None:
    hf_ids, hf_logprobs = oracle.greedy(text, images, NUM_TOKENS)
    assert_matches_greedy(response, oracle.processor.tokenizer, hf_ids, hf_logprobs)


def assert_matches_greedy(
    response: dict[str, Any], tokenizer: Any, hf_ids: list[int], hf_logprobs: Any
) -> None:
    """The served tokens are the oracle's ``hf_ids``, but for a divergence at a true near-tie (the oracle's
    top-2 logprobs within ``NEAR_TIE``: the gap is printed), after which nothing more is compared."""
    served = [entry["token"] for entry in response["choices"][0]["logprobs"]["content"]]
    assert len(served) == len(hf_ids) == response["usage"]["completion_tokens"]
    for pos, (token_id, served_token) in enumerate(zip(hf_ids, served, strict=True)):
        if tokenizer.decode([token_id]) != served_token:
            top2 = hf_logprobs[pos].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (
                f"diverged at token {pos} where the oracle's top-2 logprob gap is {gap:.6f}"
            )
            print(f"near-tie at token {pos}: logprob gap {gap:.2e}")
            return
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(hf_ids, skip_special_tokens=True)
