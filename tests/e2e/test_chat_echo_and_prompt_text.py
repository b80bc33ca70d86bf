"""vLLM's ``echo`` and ``return_prompt_text`` on chat, on a real server: with the assistant's last message
continued (``continue_final_message``), each choice's content begins with that message's text, streamed
(its own chunk after the role chunk) or not, and the rest is the answer without ``echo``; a last message
of another role echoes nothing. ``prompt_text`` is the chat template as transformers' processor renders
it, in the response or the role chunks (docs/api.md, "Request fields")."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Oracle, make_image, user_message
from tests.e2e.server import Server, stream_chunks

pytestmark = pytest.mark.slow

STARTED = "The picture shows"


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llava", "messages": messages, "max_tokens": 8, "temperature": 0, "n": 2, **extra}


def contents(server: Server, payload: dict[str, Any]) -> list[str]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text
    return [choice["message"]["content"] for choice in resp.json()["choices"]]


def test_echo_begins_each_choice_with_the_continued_message(server: Server) -> None:
    continued = [
        user_message("What is in this picture?", make_image(5)),
        {"role": "assistant", "content": [{"type": "text", "text": STARTED}]},
    ]
    template = {"add_generation_prompt": False, "continue_final_message": True}
    plain = contents(server, body(continued, **template))
    echoed = contents(server, body(continued, echo=True, **template))
    assert echoed == [STARTED + answer for answer in plain]
    chunks = stream_chunks(server, body(continued, echo=True, stream=True, **template))
    for index, expected in enumerate(echoed):
        own = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert own[1] == {"content": STARTED}  # right after the role chunk
        assert "".join(delta.get("content") or "" for delta in own) == expected

    asked = [user_message("What is in this picture?", make_image(5))]
    assert contents(server, body(asked, echo=True)) == contents(server, body(asked))


def test_prompt_text_is_the_template_transformers_renders(server: Server, oracle: Oracle) -> None:
    image = make_image(6)
    payload = body([user_message("Describe it.", image)], return_prompt_text=True, n=1)
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text
    parts = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    expected = oracle.processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    assert resp.json()["prompt_text"] == expected
    chunks = stream_chunks(server, payload | {"stream": True})
    assert chunks[0]["prompt_text"] == expected and all("prompt_text" not in c for c in chunks[1:])
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload | {"return_prompt_text": False})
    assert "prompt_text" not in plain.json()
