"""Encoder-cache connector between ordinary replicas (``--ec-role both`` on one store): replica B
answers an image replica A encoded without running its own encoder, with A's answer; the store's
failures are counted and never change an answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow


def ask(server: Server, body: dict[str, Any]) -> str:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server, Path]]:
    store = tmp_path_factory.mktemp("ec-store")
    flags = ("--ec-connector", "shared-storage", "--ec-storage-path", str(store), "--ec-role", "both")
    logs = tmp_path_factory.mktemp("ec-replicas")
    with serving(tiny_model_dir, logs, *flags) as a, serving(tiny_model_dir, logs, *flags) as b:
        yield a, b, store


def test_replica_b_loads_what_replica_a_encoded(replicas: tuple[Server, Server, Path]) -> None:
    a, b, store = replicas
    body = greedy_body([user_message("Which colours?", make_image(700), make_image(701))], max_tokens=8)
    a_before, b_before = a.metrics(), b.metrics()
    answer = ask(a, body)
    a_after = a.metrics()
    assert delta(a_before, a_after, "mmserve_encoder_runs_total") == 2
    assert delta(a_before, a_after, "mmserve_ec_saves_total") == 2
    assert len(list(store.glob("*.safetensors"))) >= 2

    assert ask(b, body) == answer
    b_after = b.metrics()
    assert delta(b_before, b_after, "mmserve_encoder_runs_total") == 0, "B ran its encoder"
    assert delta(b_before, b_after, "mmserve_ec_loads_total") == 2
    assert delta(b_before, b_after, 'mmserve_ec_bytes_total{direction="load"}') > 0
    assert delta(b_before, b_after, "mmserve_ec_saves_total") == 0, "loaded outputs are not saved again"


def test_another_salt_loads_nothing_from_the_store(replicas: tuple[Server, Server, Path]) -> None:
    a, b, _ = replicas
    body = greedy_body([user_message("Salted?", make_image(705))], max_tokens=8, cache_salt="a")
    answer = ask(a, body)
    before = b.metrics()
    assert ask(b, {**body, "cache_salt": "b"}) == answer
    middle = b.metrics()
    assert ask(b, body) == answer
    after = b.metrics()
    assert delta(before, middle, "mmserve_ec_loads_total") == 0  # no hit across salts
    assert delta(before, middle, "mmserve_encoder_runs_total") == 1
    assert delta(middle, after, "mmserve_ec_loads_total") == 1  # the same salt loads A's encode
    assert delta(middle, after, "mmserve_encoder_runs_total") == 0


def test_a_corrupt_entry_is_encoded_locally(replicas: tuple[Server, Server, Path]) -> None:
    a, b, store = replicas
    body = greedy_body([user_message("And now?", make_image(710))], max_tokens=8)
    entries = set(store.glob("*.safetensors"))
    answer = ask(a, body)
    [entry] = set(store.glob("*.safetensors")) - entries
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the embeddings: the digest no longer matches
    entry.write_bytes(bytes(data))

    before = b.metrics()
    assert ask(b, body) == answer, "a corrupt entry must never reach the model"
    after = b.metrics()
    assert delta(before, after, "mmserve_ec_load_failures_total") == 1
    assert delta(before, after, "mmserve_ec_fallback_encodes_total") == 1
    assert delta(before, after, "mmserve_encoder_runs_total") == 1
    assert delta(before, after, "mmserve_ec_saves_total") == 1, "B (a producer too) saved a good copy"


def test_the_store_gone_means_local_encodes(replicas: tuple[Server, Server, Path]) -> None:
    a, b, store = replicas
    body = greedy_body([user_message("Still there?", make_image(720))], max_tokens=8)
    answer = ask(a, body)
    for entry in store.glob("*.safetensors"):
        entry.unlink()
    before = b.metrics()
    assert ask(b, body) == answer
    after = b.metrics()
    assert delta(before, after, "mmserve_ec_loads_total") == 0
    assert delta(before, after, "mmserve_encoder_runs_total") == 1
