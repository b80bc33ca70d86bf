"""A computer-use-like agent loop of five turns on the tiny Qwen2.5-VL and Qwen3-VL, each turn a new
screenshot, the model's call to ``get_weather`` and its result: on chat with the whole history resent, and
on ``/v1/responses`` chained by ``previous_response_id``. Every turn is served, the history's images hit
the caches (counters), and the answers equal a cold server's (every cache off)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import data_url, make_image
from tests.e2e.server import Server
from tests.e2e.test_tool_calling import FAMILIES, NAMED, WEATHER, ask, body, responses_body

pytestmark = pytest.mark.slow

OFF = (
    "--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--encoder-cache-tokens", "0",
    "--no-enable-prefix-caching",
)  # fmt: skip


def agent_turns(server: Server, family: str, num_turns: int) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """A computer-use-like loop: each turn a new screenshot and the whole history (earlier screenshots,
    the assistant's calls, their results); the model must call ``get_weather``. Each turn's message and
    the /metrics deltas around it."""
    history: list[dict[str, Any]] = []
    turns = []
    for turn in range(num_turns):
        screenshot = make_image(970 + turn, (320, 240))
        parts = [{"type": "image_url", "image_url": {"url": data_url(screenshot)}}]
        history.append(
            {"role": "user", "content": [*parts, {"type": "text", "text": f"Step {turn}: go on."}]}
        )
        payload = {**body(family, NAMED, parallel_tool_calls=False), "messages": history}
        before = server.metrics()
        message = ask(server, payload)["choices"][0]["message"]
        after = server.metrics()
        deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
        turns.append((message, deltas))
        [call] = message["tool_calls"]
        history.append({"role": "assistant", "content": None, "tool_calls": [call]})
        history.append({"role": "tool", "tool_call_id": call["id"], "content": f'{{"step": {turn}}}'})
    return turns


def responses_agent_turns(
    server: Server, family: str, num_turns: int
) -> list[tuple[list[dict[str, Any]], dict[str, float], int]]:
    """The same loop on /v1/responses, chained by ``previous_response_id``: each turn sends only the last
    call's result and the new screenshot. Each turn's calls (name, decoded arguments), the /metrics
    deltas around it, and its input tokens."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    previous: Any = None
    turns = []
    for turn in range(num_turns):
        screenshot = make_image(980 + turn, (320, 240))
        user = {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_url(screenshot)},
                {"type": "input_text", "text": f"Step {turn}: go on."},
            ],
        }
        items: list[Any] = [user]
        if previous is not None:
            [call] = [item for item in previous.output if item.type == "function_call"]
            result = {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": f'{{"step": {turn - 1}}}',
            }
            items = [result, user]
        extra = {"previous_response_id": previous.id} if previous is not None else {}
        before = server.metrics()
        previous = client.responses.create(**responses_body(family, NAMED_RESPONSES, input=items, **extra))
        after = server.metrics()
        deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
        calls = [
            {"name": item.name, "arguments": json.loads(item.arguments)}
            for item in previous.output
            if item.type == "function_call"
        ]
        assert previous.usage is not None
        turns.append((calls, deltas, previous.usage.input_tokens))
    return turns


NAMED_RESPONSES = {"type": "function", "name": "get_weather"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_five_turn_agent_loop_hits_the_caches_and_equals_a_cold_server(
    family: str, family_server: Callable[..., Server]
) -> None:
    warm = agent_turns(family_server(family), family, 5)
    cold = agent_turns(family_server(family, *OFF), family, 5)
    for turn, ((message, deltas), (cold_message, _)) in enumerate(zip(warm, cold, strict=True)):
        assert [c["function"] for c in message["tool_calls"]] == [
            c["function"] for c in cold_message["tool_calls"]
        ]
        assert deltas["mmserve_encoder_runs_total"] == 1, turn  # only the new screenshot is encoded
        assert deltas["mmserve_mm_processor_cache_hits_total"] == turn  # every earlier one is a hit
        assert deltas["mmserve_mm_ipc_cache_hits_total"] == turn


@pytest.mark.parametrize("family", FAMILIES)
def test_a_five_turn_agent_loop_on_stored_responses_hits_the_caches_and_equals_a_cold_server(
    family: str, family_server: Callable[..., Server]
) -> None:
    warm = responses_agent_turns(family_server(family), family, 5)
    cold = responses_agent_turns(family_server(family, *OFF), family, 5)
    for turn, ((calls, deltas, num_tokens), (cold_calls, _, cold_num_tokens)) in enumerate(
        zip(warm, cold, strict=True)
    ):
        assert calls == cold_calls and len(calls) == 1, turn
        jsonschema.validate(calls[0]["arguments"], WEATHER)
        assert num_tokens == cold_num_tokens  # the stored history is rendered in full
        assert deltas["mmserve_encoder_runs_total"] == 1, turn  # the stored screenshots are all hits
        assert deltas["mmserve_mm_processor_cache_hits_total"] == turn
        assert deltas["mmserve_mm_ipc_cache_hits_total"] == turn
    assert [num_tokens for _, _, num_tokens in warm] == sorted({n for _, _, n in warm})  # it grows
