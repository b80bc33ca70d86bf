"""The HTTP surface as clients use it: raw JSON (curl), the ``openai`` SDK, streaming with usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import data_url, make_image, user_message
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def test_curl_style_request_returns_chat_completion(server: Server) -> None:
    body = {
        "model": "tiny-llava",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(make_image(10))}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "tiny-llava"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in {"stop", "length"}
    assert data["usage"]["prompt_tokens"] > 576  # the image alone is 576 placeholder tokens
    assert 1 <= data["usage"]["completion_tokens"] <= 8


def test_models_and_health(server: Server) -> None:
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llava"]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    assert client.models.retrieve("tiny-llava").model_dump(exclude_none=True) == models["data"][0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    head = httpx.head(f"{server.base_url}/health")  # a load balancer's probe
    assert head.status_code == 200 and head.content == b""


def test_openai_sdk_non_streaming(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    completion = client.chat.completions.create(
        model="tiny-llava",
        messages=[user_message("Describe it.", make_image(11))],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert completion.object == "chat.completion"
    assert completion.usage is not None and completion.usage.completion_tokens == len(
        completion.choices[0].logprobs.content
    )
    top = completion.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob


def test_openai_sdk_streaming_with_usage(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [user_message("Describe it.", make_image(12))]
    stream = client.chat.completions.create(
        model="tiny-llava",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 16
    full = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.content == text


def test_seeded_sampling_is_reproducible(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [user_message("Say something.", make_image(13))]

    def sample(seed: int) -> str | None:
        out = client.chat.completions.create(
            model="tiny-llava",
            messages=messages,
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 50},
        )
        return out.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_stop_string_truncates_output(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [user_message("Describe it.", make_image(14))]
    full = (
        client.chat.completions.create(
            model="tiny-llava",
            messages=messages,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    assert full and len(full) > 6
    stop = full[4:7]
    cut = client.chat.completions.create(
        model="tiny-llava",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_min_tokens_holds_back_stop_strings_as_vllm(server: Server) -> None:
    """A stop string counts only where it ends in a token past the first ``min_tokens``."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [user_message("Describe it.", make_image(14))]
    ask = {"model": "tiny-llava", "messages": messages, "max_tokens": 24, "temperature": 0}
    full = client.chat.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].message.content
    assert full and len(full) > 6
    stop = full[:2]  # whole within the first tokens' text
    held = client.chat.completions.create(
        **ask, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 8}
    )
    assert held.usage is not None and held.usage.completion_tokens > 8, held
    content = held.choices[0].message.content or ""
    assert full.startswith(content) and len(content) > len(stop), (content, full)
    if held.choices[0].finish_reason == "stop":  # a later occurrence, past the eighth token
        assert full[len(content) :].startswith(stop)
    else:
        assert held.choices[0].finish_reason == "length" and content == full


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_in_the_text_released_at_the_end_is_a_stop(server: Server, stream: bool) -> None:
    """The last token, half a character, is held back until the answer ends at its max tokens; the stop
    string "\ufffd" then matches in what is released: the answer was stopped, not cut at the length."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    half = 97  # (a byte of a UTF-8 sequence alone in the tiny tokenizer: "\ufffd" decoded by itself)
    ask = {"model": "tiny-llava", "messages": [user_message("Hi.")], "max_tokens": 1, "temperature": 0}
    extra = {"allowed_token_ids": [half], "ignore_eos": True}
    if not stream:
        [choice] = client.chat.completions.create(**ask, stop=["\ufffd"], extra_body=extra).choices
        assert (choice.message.content, choice.finish_reason) == ("", "stop")
        return
    chunks = list(client.chat.completions.create(**ask, stop=["\ufffd"], extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"
