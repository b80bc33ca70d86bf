"""The structured-output knobs on a server of their own: a compile past
``--structured-output-compile-timeout-s`` is a 400 for its request while the server serves on, and
``--structured-output-cache-mb`` bounds what the engine keeps."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.metrics import Metrics, delta
from tests.e2e.server import Server, serving

pytestmark = pytest.mark.slow

# ~51,000 characters that take xgrammar seconds to compile over the tiny vocabulary (and ~8 MB), compact:
# 2,000 optional properties (their compile time grows far faster than their number)
HOSTILE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
SMALL = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--structured-output-compile-timeout-s", "1", "--structured-output-cache-mb", "1")
    with serving(tiny_model_dir, tmp_path_factory.mktemp("structured-limits"), *flags) as srv:
        yield srv


def chat(server: Server, schema: dict[str, Any]) -> httpx.Response:
    payload = {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": "A record, please."}],
        "max_tokens": 40,
        "temperature": 0,
        "structured_outputs": {"json": schema, "disable_any_whitespace": True},
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=120)


def test_a_compile_past_the_timeout_is_a_400_and_the_server_serves_on(limited: Server) -> None:
    """The hostile request gets its 400 at the timeout, while its compile runs on; the server answers a
    constrained request whose grammar it holds and a free-text one meanwhile. (A new grammar would wait
    for a compile thread behind it: the timeout counts that wait too.)"""
    assert len(json.dumps(HOSTILE)) < 65536
    assert chat(limited, SMALL).status_code == 200  # its grammar is compiled and kept
    before = limited.metrics()
    started = time.monotonic()
    resp = chat(limited, HOSTILE)
    assert resp.status_code == 400, resp.text
    assert time.monotonic() - started < 30  # the timeout, not the compile, ended the wait
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("constraint_compile_timeout", "structured_outputs.json")
    assert "--structured-output-compile-timeout-s" in error["message"]
    ok = chat(limited, SMALL)
    assert ok.status_code == 200, ok.text
    jsonschema.validate(json.loads(ok.json()["choices"][0]["message"]["content"]), SMALL)
    free = httpx.post(
        f"{limited.base_url}/v1/chat/completions",
        json={"model": "tiny-llava", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert free.status_code == 200, free.text
    after = limited.metrics()
    assert delta(before, after, "mmserve_structured_output_compile_timeouts_total") == 1
    assert delta(before, after, "mmserve_structured_output_compile_failures_total") == 1


def wait_for_compiles(server: Server) -> Metrics:
    """Until no compile runs (each constrained answer brings the engine's current figures)."""
    deadline = time.monotonic() + 120
    while True:
        assert chat(server, SMALL).status_code == 200
        metrics = server.metrics()
        if metrics["mmserve_structured_output_compiles_running"] == 0:
            return metrics
        assert time.monotonic() < deadline, "a compile never ended"
        time.sleep(0.5)


def idle_until_compiled(server: Server) -> Metrics:
    """Until no compile runs, reading the metrics only: an idle engine reports a compile's end."""
    deadline = time.monotonic() + 120
    while (metrics := server.metrics())["mmserve_structured_output_compiles_running"] != 0:
        assert time.monotonic() < deadline, "an ended compile was never reported"
        time.sleep(0.5)
    return metrics


def test_the_cache_keeps_no_more_than_its_bound(limited: Server) -> None:
    """An 8 MB grammar, once its compile ends, is not kept by a 1 MiB cache; small ones are. Its
    compile overran the timeout, so a repeat is refused at once instead of compiled again."""
    before = wait_for_compiles(limited)  # the previous test's abandoned compile, if it still runs
    hostile = {**HOSTILE, "title": "not seen before"}
    assert chat(limited, hostile).status_code == 400
    after = idle_until_compiled(limited)  # (no request asks: the engine, idle, says so itself)
    assert delta(before, after, "mmserve_structured_output_compile_seconds_count") >= 1  # it ended
    assert 0 < after["mmserve_structured_output_cache_bytes"] <= 1 << 20
    repeat = chat(limited, hostile)
    assert repeat.status_code == 400 and repeat.json()["error"]["code"] == "constraint_compile_timeout"
    # refused at once, not compiled again (that compile would run on for seconds past its 1 s timeout)
    now = limited.metrics()
    assert now["mmserve_structured_output_compiles_running"] == 0
    assert delta(after, now, "mmserve_structured_output_compile_seconds_count") == 0
