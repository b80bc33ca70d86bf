"""Bad input gets a clear OpenAI-style error (never a 500 or a hang) and disturbs neither the requests
in flight nor the caches."""

from __future__ import annotations

import base64
import json
import threading
import time
from importlib import metadata
from typing import Any

import httpx
import pytest
from packaging.version import Version

from tests.e2e.conftest import data_url, greedy_body, make_image, user_message
from tests.e2e.server import Server, free_port

pytestmark = pytest.mark.slow
JSON_HEADERS = {"Content-Type": "application/json"}


def post(server: Server, body: Any = None, *, content: bytes | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=body,
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


def image_part(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}],
    }


def assert_error(
    resp: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_malformed_json(server: Server) -> None:
    error = assert_error(post(server, content=b'{"model": "tiny-llava", "messages": ['), 400)
    assert error["type"] == "invalid_request_error"


def test_schema_errors_name_the_param(server: Server) -> None:
    assert_error(post(server, {"model": "tiny-llava"}), 400, param="messages")
    bad_part = {"model": "tiny-llava", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    error = assert_error(post(server, bad_part), 400)
    assert error["param"].startswith("messages[0].content[0]")
    assert_error(
        post(
            server, {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}
        ),
        400,
        param="temperature",
    )


HI = [{"role": "user", "content": "hi"}]
CALL = {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"n": 17}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"1": 250}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, None),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        # numbers the engine cannot carry: these were 500s
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**64}, "top_k"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"max_tokens": None, "min_tokens": 5000}, "min_tokens"),  # past the default max tokens too
        ({"logit_bias": {"100": 5, "0100": -5}}, "logit_bias"),  # one token, two biases
        ({"allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids"),  # only EOS, which it masks
        # OpenAI's assistant-message fields that mmserve cannot render
        ({"messages": [*HI, {"role": "assistant", "function_call": CALL}]}, "messages[1].function_call"),
        ({"messages": [*HI, {"role": "assistant", "audio": {"id": "audio_1"}}]}, "messages[1].audio"),
        ({"messages": [{"role": "user", "content": "hi", "refusal": "no"}]}, "messages[0].refusal"),
        ({"messages": [*HI, {"role": "assistant", "content": "a", "refusal": "b"}]}, "messages[1].refusal"),
    ],
)
def test_each_bad_parameter_is_a_400_naming_it(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": "tiny-llava", "messages": HI, "max_tokens": 2, **fields}
    error = assert_error(post(server, body), 400, code="invalid_value")
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (param or "messages[0].content[0].type"), error
    assert error["param"] in error["message"]


def test_allowed_token_ids_with_an_output_constraint_is_a_400(server: Server) -> None:
    """Together they could leave no token to sample."""
    body = {"model": "tiny-llava", "messages": HI, "max_tokens": 2, "allowed_token_ids": [5]}
    body["response_format"] = {"type": "json_object"}
    error = assert_error(post(server, body), 400, param="allowed_token_ids")
    assert "response_format" in error["message"]


def test_nan_is_a_400(server: Server) -> None:
    # Python's json reads the non-standard NaN literal; mmserve's strict JSON does not
    content = b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    error = assert_error(post(server, content=content), 400, code="invalid_json")
    assert f"position {content.index(b'NaN')}" in error["message"]


def test_unknown_model(server: Server) -> None:
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(server, body), 404, code="model_not_found", param="model")


def test_undecodable_image_names_the_part(server: Server) -> None:
    url = "data:image/png;base64," + base64.b64encode(b"this is not a png at all").decode()
    error = assert_error(post(server, {"model": "tiny-llava", "messages": [image_part(url)]}), 400)
    assert error["param"] == "messages[0].content[1].image_url.url"


def test_data_url_that_is_not_base64(server: Server) -> None:
    error = assert_error(
        post(
            server, {"model": "tiny-llava", "messages": [image_part("data:image/png;base64,@@not base64@@")]}
        ),
        400,
    )
    assert error["param"] == "messages[0].content[1].image_url.url"


def test_unreachable_url_is_a_client_error(server: Server) -> None:
    url = f"http://127.0.0.1:{free_port()}/nothing-listens-here.png"
    resp = post(server, {"model": "tiny-llava", "messages": [image_part(url)]})
    assert 400 <= resp.status_code < 500
    assert_error(resp, resp.status_code, param="messages[0].content[1].image_url.url")


def test_fetch_timeout_is_a_client_error(server: Server, image_http_server: str) -> None:
    resp = post(server, {"model": "tiny-llava", "messages": [image_part(image_http_server + "/slow.png")]})
    assert 400 <= resp.status_code < 500, resp.text
    assert_error(resp, resp.status_code)


def test_prompt_longer_than_max_model_len(server: Server) -> None:
    text = " ".join(f"word{i}" for i in range(3000))
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": text}]}
    resp = post(server, body)
    assert_error(resp, 400, code="context_length_exceeded")
    message = resp.json()["error"]["message"]  # the prompt's length, never a negative completion
    assert "leaves no room for a completion" in message and "-" not in message, message
    body = {"model": "tiny-llava", "messages": [user_message("hi", make_image(500))], "max_tokens": 5000}
    resp = post(server, body)
    assert_error(resp, 400, code="context_length_exceeded")
    assert "5000 in the completion" in resp.json()["error"]["message"]


def test_bad_input_disturbs_neither_requests_nor_caches(server: Server, image_http_server: str) -> None:
    image = make_image(501)
    good = greedy_body([user_message("Steady?", image)], max_tokens=48)
    expected = post(server, good).json()["choices"][0]["message"]["content"]
    result: dict[str, Any] = {}

    def run_good() -> None:
        result["response"] = post(server, good)

    thread = threading.Thread(target=run_good)
    thread.start()
    bad_bodies = [
        {"model": "tiny-llava", "messages": [image_part("data:image/png;base64,!!!")]},
        {"model": "tiny-llava", "messages": [image_part(f"http://127.0.0.1:{free_port()}/x.png")]},
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        {"model": "tiny-llava", "messages": [user_message("hi", image)], "max_tokens": 99999},
    ]
    for body in bad_bodies:
        assert 400 <= post(server, body).status_code < 500
    thread.join(120)
    assert result["response"].status_code == 200
    assert result["response"].json()["choices"][0]["message"]["content"] == expected
    before = server.metrics()
    assert post(server, good).json()["choices"][0]["message"]["content"] == expected
    after = server.metrics()
    assert after["mmserve_mm_ipc_cache_hits_total"] - before["mmserve_mm_ipc_cache_hits_total"] == 1
    assert after["mmserve_encoder_runs_total"] == before["mmserve_encoder_runs_total"]
    assert after["mmserve_mm_ipc_cache_resends_total"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("best_of", 2),
        ("use_beam_search", True),
        ("logprob_token_ids", [1]),
        ("chat_template", "{{ messages }}"),
    ],
)
def test_a_field_mmserve_does_not_implement_is_a_400_naming_it(
    server: Server, field: str, value: Any
) -> None:
    body = greedy_body([{"role": "user", "content": "hi"}], 2, **{field: value})
    error = assert_error(post(server, body), 400, param=field)
    assert field in error["message"]


def test_fields_without_effect_are_accepted_and_an_unknown_one_is_logged_once(server: Server) -> None:
    name = "x_mmserve_e2e_unknown_field"
    body = greedy_body(
        [{"role": "user", "content": "hi"}], 2, user="u-1", metadata={"k": "v"}, store=False, **{name: 1}
    )
    for _ in range(2):
        resp = post(server, body)
        assert resp.status_code == 200, resp.text
    lines = [line for line in server.process.log().splitlines() if name in line]
    assert len(lines) == 1 and "ignored" in lines[0], lines


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/tokenize"])
def test_a_lone_surrogate_escape_is_invalid_json(server: Server, path: str) -> None:
    """``"\\ud800"`` outside a pair is no Unicode text: refused where the body is read, before a tokenizer,
    an answer or an engine message could fail on it."""
    body = {"model": "tiny-llava", "max_tokens": 2, "max_output_tokens": 16}
    body |= (
        {"input": "PLACE"}
        if path == "/v1/responses"
        else {"messages": [{"role": "user", "content": "PLACE"}]}
    )
    content = json.dumps(body).replace("PLACE", "a\\ud800b").encode()
    resp = httpx.post(f"{server.base_url}{path}", content=content, headers=JSON_HEADERS, timeout=60)
    error = assert_error(resp, 400, code="invalid_json")
    assert "surrogate" in error["message"]
    model = json.dumps({"model": "PLACE", "messages": HI}).replace("PLACE", "\\udfff").encode()
    assert_error(post(server, content=model), 400, code="invalid_json")
    assert post(server, greedy_body(HI, 2)).status_code == 200  # and the next request is served


def test_deeply_nested_arguments_in_the_history_are_a_400(server: Server) -> None:
    nested = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": f'{{"a": {nested}}}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    error = assert_error(post(server, greedy_body(messages, 2)), 400)
    assert "nested too deeply" in error["message"] and "arguments" in str(error["param"])


def test_a_constraint_no_answer_can_satisfy_is_a_400(server: Server) -> None:
    """A constraint whose language is empty is the request's fault, a 400 at once: a schema that only refers
    to itself (xgrammar from 0.2.9 refuses it as it compiles; earlier ones compile it, and it allows no
    token), a grammar that allows no first token, and one that allows one token and then none."""
    schema = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    body = greedy_body(
        HI, 8, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    refused_as_it_compiles = Version(metadata.version("xgrammar")) >= Version("0.2.9")
    code = "invalid_constraint" if refused_as_it_compiles else "constraint_unsatisfiable"
    assert_error(post(server, body), 400, code=code)
    for grammar in ("root ::= root", 'root ::= "{" a\na ::= a "x"'):
        body = greedy_body(HI, 8, structured_outputs={"grammar": grammar})
        assert_error(post(server, body), 400, code="constraint_unsatisfiable")
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
            text = resp.read().decode()
        if resp.status_code == 200:  # a stream already started: its error event
            assert '"code":"constraint_unsatisfiable"' in text.replace(" ", ""), text
        else:
            assert resp.status_code == 400 and "constraint_unsatisfiable" in text, text


def test_an_image_longer_than_200_times_its_width_is_a_400(server: Server) -> None:
    """LLaVA scales the shorter side up to 336 pixels: 1 x 10,000 would become 336 x 3,360,000 (11 GB)."""
    url = data_url(make_image(7, size=(1, 10_000)))
    error = assert_error(
        post(server, greedy_body([image_part(url)], 2)), 400, code="image_aspect_ratio_too_large"
    )
    assert error["param"] == "messages[0].content[1].image_url.url"
    thin = data_url(make_image(7, size=(2, 400)))  # 200 times: still taken
    assert post(server, greedy_body([image_part(thin)], 2)).status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(server: Server) -> None:
    """Megabytes of text take the tokenizer seconds: meanwhile the API process answers others."""
    long = greedy_body([{"role": "user", "content": "hello world " * 700_000}], 2)  # 8.4 MB
    finished: dict[str, float] = {}

    def send_long() -> None:
        resp = post(server, long)
        finished["long"] = time.monotonic()
        finished["status"] = resp.status_code

    sender = threading.Thread(target=send_long)
    sender.start()
    time.sleep(1.0)  # sent and read; now being tokenized
    health = httpx.get(f"{server.base_url}/health", timeout=60)
    finished["health"] = time.monotonic()
    sender.join(120)
    assert health.status_code == 200 and finished["status"] == 400  # context_length_exceeded
    assert finished["health"] < finished["long"]


def test_responses_errors_name_the_responses_fields(server: Server) -> None:
    """The Responses API runs as a chat request inside: its errors name its own fields, not chat's."""
    url = f"{server.base_url}/v1/responses"
    image = {"type": "input_image", "image_url": "data:image/png;base64,!!!"}
    content = [{"type": "input_text", "text": "look"}, image]
    items = [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]
    body = {"model": "tiny-llava", "max_output_tokens": 2, "instructions": "Be brief.", "input": items}
    # the image's own input item and part (instructions are a chat message before them)
    assert_error(httpx.post(url, json=body, timeout=60), 400, param="input[1].content[1].image_url")
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}
    error = assert_error(httpx.post(url, json={**body, "input": "hi", "text": text}, timeout=60), 400)
    assert str(error["param"]).startswith("text.format"), error


@pytest.mark.parametrize("kwargs", [{"size": "big"}, {"do_resize": "yes"}, {"bogus": 1}])
def test_options_the_processor_cannot_take_are_invalid_mm_processor_kwargs(
    server: Server, kwargs: dict[str, Any]
) -> None:
    body = greedy_body([user_message("Hi.", make_image(520))], 2, mm_processor_kwargs=kwargs)
    assert_error(post(server, body), 400, code="invalid_mm_processor_kwargs", param="mm_processor_kwargs")
