"""A model's ``generation_config.json`` sampling fields are the defaults a request overrides
(``--generation-config auto``, the default, as vLLM); ``--generation-config vllm`` ignores them. Two
servers on a copy of the tiny LLaVA whose file asks for a strong repetition penalty, greedy-like top-k
and 10 new tokens, one in each mode."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import make_image, user_message
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow

DEFAULTS = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.6, "max_new_tokens": 10}
MESSAGES = [user_message("Tell me about the picture, then about it again.", make_image(4242))]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generation-config") / "tiny-llava"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def auto_server(model_with_defaults: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(model_with_defaults, tmp_path_factory.mktemp("gen-auto")) as srv:
        yield srv


@pytest.fixture(scope="module")
def vllm_server(model_with_defaults: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--generation-config", "vllm")
    with serving(model_with_defaults, tmp_path_factory.mktemp("gen-vllm"), *flags) as srv:
        yield srv


def answer(server: Server, **fields: Any) -> tuple[str, int]:
    body = {"model": "tiny-llava", "messages": MESSAGES, "ignore_eos": True, **fields}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


def test_the_models_defaults_apply_a_request_overrides_them_and_vllm_mode_ignores_them(
    auto_server: Server, vllm_server: Server
) -> None:
    # vllm mode: no defaults but vLLM's, so the request's own fields decide
    penalised = answer(vllm_server, temperature=0, repetition_penalty=1.6, max_tokens=10)
    plain = answer(vllm_server, temperature=0, max_tokens=10)
    assert penalised != plain  # the penalty changes this answer, so the comparisons below can fail
    assert answer(auto_server) == penalised  # top_k 1: greedy, whatever the temperature; 10 tokens
    assert answer(auto_server, temperature=0, max_tokens=10) == penalised  # the penalty is the model's
    assert answer(auto_server, repetition_penalty=1.0) == plain
    assert answer(auto_server, max_tokens=3)[1] == 3
    assert "sampling defaults from" in auto_server.process.log()
    assert "sampling defaults are vLLM's (--generation-config vllm)" in vllm_server.process.log()
