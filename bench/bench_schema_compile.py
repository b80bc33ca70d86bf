"""A JSON schema's compile: mmserve's engine (exact patterns and formats, docs/architecture.md,
"Structured outputs") against xgrammar's own ``compile_json_schema`` (what vLLM's and SGLang's xgrammar
backends call), side by side in one process over one tokenizer.

    python bench/bench_schema_compile.py [--model models/tiny-llava] [--repeats 3] [--chart PATH]

Four schemas: ten everyday patterns (an e-mail address, a phone number, a UUID, a postcode, a semantic
version, …); the five formats mmserve compiles as patterns of its own (``ipv4``, ``ipv6``, ``date``,
``date-time``, ``time``); 120 long bounded repetitions (``([a-z0-9]{2,300}@){1,N}``, N = 30…149, as a
hostile client may send); 1,500 optional properties (no pattern: the control). Each compile is median
seconds over ``--repeats`` runs (compilers without a cache), then mmserve's ratio to xgrammar's.
Beside the times, whether each took a string its pattern forbids (``ABC12`` for ``^[A-Z]{3}( [0-9]+)?$``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import xgrammar as xgr
from bench_throughput import REPO, git
from charts import Panel, draw
from transformers import AutoTokenizer

from engine.structured.backend import XGrammarBackend
from wire.protocol import Constraint, ConstraintKind

EVERYDAY = {
    "email": r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$",
    "phone": r"^\+?[1-9][0-9]{7,14}$",
    "uuid": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "postcode": r"^[0-9]{5}(-[0-9]{4})?$",
    "version": r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[a-z0-9.]+)?$",
    "sku": r"^[A-Z]{2,4}-[0-9]{3,8}$",
    "iban": r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$",
    "colour": r"^#[0-9a-fA-F]{6}$",
    "name": r"^[A-Za-z ,.'-]{1,100}$",
    "code": r"^[A-Z]{3}( [0-9]+)?$",
}
FORBIDDEN = '{"code": "ABC12"}'  # "code" forbids it: the digits need their space


def strings(fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"type": "object", "properties": fields, "additionalProperties": False}


SCHEMAS = {
    "10 everyday patterns": strings({k: {"type": "string", "pattern": p} for k, p in EVERYDAY.items()}),
    "5 formats": strings(
        {f: {"type": "string", "format": f} for f in ("ipv4", "ipv6", "date", "date-time", "time")}
    ),
    "120 long repetitions": strings(
        {f"p{i}": {"type": "string", "pattern": f"([a-z0-9]{{2,300}}@){{1,{30 + i}}}"} for i in range(120)}
    ),
    "1,500 optional properties": strings({f"p{i}": {"type": "string"} for i in range(1500)}),
}


def median_seconds(compile_once: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, compiled = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        compiled = compile_once()
        times.append(time.perf_counter() - started)
    return statistics.median(times), compiled


def takes(compiled: Any, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and matcher.is_completed()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chart", type=Path, default=REPO / "docs" / "img" / "schema_compile.png")
    args = parser.parse_args()
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    )
    print(f"vocabulary: {info.vocab_size} tokens ({args.model}); median of {args.repeats}; compact JSON")
    print(f"{'schema':28}{'xgrammar s':>12}{'mmserve s':>12}{'ratio':>9}   takes {FORBIDDEN}")
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # (both: no cache)
    backend = XGrammarBackend(args.model, info.vocab_size)
    rows: dict[str, dict[str, float]] = {}
    for name, schema in SCHEMAS.items():
        spec = json.dumps(schema)

        def theirs(spec: str = spec) -> Any:
            return compiler.compile_json_schema(spec, any_whitespace=False)

        def ours(spec: str = spec) -> Any:
            return backend.compile(Constraint(ConstraintKind.JSON_SCHEMA, spec, any_whitespace=False))

        their_s, their_grammar = median_seconds(theirs, args.repeats)
        our_s, our_grammar = median_seconds(ours, args.repeats)
        wrong = "-"
        if "code" in schema["properties"]:
            wrong = f"xgrammar {takes(their_grammar, FORBIDDEN)}, mmserve {takes(our_grammar, FORBIDDEN)}"
        print(f"{name:28}{their_s:12.3f}{our_s:12.3f}{their_s / our_s:8.1f}x   {wrong}")
        rows[name] = {"xgrammar's compile_json_schema": their_s * 1000, "mmserve": our_s * 1000}
    footnote = (
        f"bench/bench_schema_compile.py · {date.today()} · {git('rev-parse', '--short', 'HEAD')} · 2 cores"
    )
    panel = Panel("Compile of one schema (ms, log scale)", "ms", rows, fmt="{:.0f}", log=True)
    draw(args.chart, "A JSON schema's compile: xgrammar's own against mmserve's", [panel], footnote)


if __name__ == "__main__":
    main()
