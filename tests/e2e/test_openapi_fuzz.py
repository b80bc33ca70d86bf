"""Schemathesis against the server's own /openapi.json: no request, valid or not, gets a 5xx.

Every route gets schemathesis' boundary cases (its coverage phase) and a bounded number of generated
cases, valid and invalid. Schemathesis' pytest plugin does not run under pytest 9 (``_nodeid``), so
the cases come from its Python API and each operation is one hypothesis test here.

The server is the session's uncached one (a POST /reset_mm_cache from the fuzzer must not disturb
the cache tests that share the session's default server; that one has no cache to reset). Nothing
leaves the machine: every generated image URL that is not a ``data:`` URL is replaced with a small PNG
``data:`` URL before it is sent, and the server is started with ``--allowed-media-domains
fuzz.invalid`` (a name that never resolves), so a URL that slipped through would still be refused
before any lookup. Requests are kept small (at most
``MAX_TOKENS`` tokens) and name the served model, so that valid ones reach the engine.
"""

from __future__ import annotations

import base64
import io
import itertools
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from PIL import Image
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MAX_TOKENS = 4
MAX_EXAMPLES = 50  # per operation and generation mode
MODEL = "tiny-llava"


def _png_data_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (30, 160, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SAFE_IMAGE_URL = _png_data_url()


@pytest.fixture(scope="module")
def fuzz_server(uncached_server: Server) -> Server:
    return uncached_server


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def keep_local(value: Any) -> Any:
    """``value`` with every ``url`` that is not a ``data:`` URL replaced by ``SAFE_IMAGE_URL``, at any
    depth (the fuzzer puts parts where it likes; only ``data:`` URLs are decoded in-process)."""
    if isinstance(value, dict):
        return {
            key: SAFE_IMAGE_URL
            if key == "url" and not (isinstance(item, str) and item.startswith("data:"))
            else keep_local(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [keep_local(item) for item in value]
    return value


def keep_small(body: dict[str, Any]) -> None:
    """At most ``MAX_TOKENS`` tokens: a valid request without a limit would fill the context."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int | float) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def test_sanitizers() -> None:
    body = {
        "messages": [
            {"content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/x"}}]},
            {"content": [{"image_url": {"url": "data:image/png;base64,AAAA"}}, {"url": 5}]},
        ],
        "max_completion_tokens": 10**9,
    }
    safe = keep_local(body)
    keep_small(safe)
    assert safe["messages"][0]["content"][0]["image_url"]["url"] == SAFE_IMAGE_URL
    assert safe["messages"][1]["content"][0]["image_url"]["url"] == "data:image/png;base64,AAAA"
    assert safe["messages"][1]["content"][1]["url"] == SAFE_IMAGE_URL
    assert safe["max_completion_tokens"] == MAX_TOKENS and "max_tokens" not in safe
    unlimited: dict[str, Any] = {"messages": []}
    keep_small(unlimited)
    assert unlimited["max_tokens"] == MAX_TOKENS


def give_content(messages: Any) -> None:
    """The schema lets ``content`` default to null, the server wants it outside assistant turns: fill
    it in, or nearly every generated request stops at that check."""
    for message in messages if isinstance(messages, list) else []:
        if (
            isinstance(message, dict)
            and message.get("content") is None
            and message.get("role") != "assistant"
        ):
            message["content"] = "Describe it."


def send(case: schemathesis.Case) -> None:
    if isinstance(case.body, dict):
        body = keep_local(case.body)
        keep_small(body)
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        give_content(body.get("messages"))
        case.body = body
    case.call_and_validate(checks=[not_a_server_error], timeout=60)


def operations(api_schema: Any) -> list[Any]:
    return [result.ok() for result in api_schema.get_all_operations()]


def test_every_route_is_fuzzed(api_schema: Any) -> None:
    labels = {operation.label for operation in operations(api_schema)}
    assert labels == {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /v1/models/{model}",
        "GET /health",
        "HEAD /health",
        "GET /metrics",
        "POST /reset_mm_cache",
        "POST /tokenize",
        "POST /detokenize",
        "POST /v1/responses",
        "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}",
        "POST /v1/responses/input_tokens",
        "GET /v1/responses/{response_id}/input_items",
        "POST /v1/responses/{response_id}/cancel",
    }


def test_boundary_cases_get_no_server_error(api_schema: Any) -> None:
    for operation in operations(api_schema):
        config = api_schema.config.generation_for(operation=operation, phase="coverage")
        modes = list(GenerationMode)
        for case in api_schema.iter_coverage_cases(
            operation, generation_modes=modes, generation_config=config
        ):
            send(case)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
def test_generated_requests_get_no_server_error(api_schema: Any, mode: GenerationMode) -> None:
    for operation in operations(api_schema):
        has_inputs = operation.get_request_payload_content_types() or list(operation.iter_parameters())
        if mode is GenerationMode.NEGATIVE and not has_inputs:
            continue  # nothing to make invalid

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(mode))
        def run(case: schemathesis.Case) -> None:
            send(case)

        try:
            run()
        except Unsatisfiable:
            # no input of it can be made invalid: any name is a name
            assert (mode, operation.label) == (GenerationMode.NEGATIVE, "GET /v1/models/{model}")


# Random integers rarely reach the edges of what the engine's wire format (int64/uint64) and torch can
# carry; these did (seed, top_k, min_tokens were 500s), so every numeric field is tried at them.
EXTREME_NUMBERS = [2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, -0.0]


def numeric_fields(openapi: dict[str, Any], request: str = "ChatCompletionRequest") -> list[str]:
    properties = openapi["components"]["schemas"][request]["properties"]

    def types(schema: dict[str, Any]) -> set[str]:
        found = {schema["type"]} if isinstance(schema.get("type"), str) else set()
        return found.union(*(types(option) for option in schema.get("anyOf", [])))

    return [name for name, schema in properties.items() if types(schema) & {"integer", "number"}]


def test_extreme_numbers_get_no_server_error(fuzz_server: Server) -> None:
    openapi = httpx.get(f"{fuzz_server.base_url}/openapi.json").json()
    fields = numeric_fields(openapi)
    assert {"seed", "top_k", "min_tokens", "max_tokens", "temperature", "top_logprobs"} <= set(fields)
    for name in fields:
        for value in EXTREME_NUMBERS:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            body[name] = value
            response = httpx.post(f"{fuzz_server.base_url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code < 500, (name, value, response.text)
    for name, value in itertools.product(
        ["prompt", *numeric_fields(openapi, "CompletionRequest")], EXTREME_NUMBERS
    ):
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
        body[name] = [1, value] if name == "prompt" else value  # (a prompt's token ids)
        response = httpx.post(f"{fuzz_server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code < 500, (name, value, response.text)
