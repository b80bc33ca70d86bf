"""docs/configuration.md, rendered from the code: every flag and environment variable of ``mmserve
serve|api|engine|worker`` (the fields of ``Settings``), then ``proxy``, ``ray serve`` (its own flags),
``build-tiny-model`` and ``curve-keygen``. Defaults and descriptions are read from the parser ``mmserve
--help`` prints, so the page and the help cannot disagree.

    .venv/bin/python -m app.launch.config_doc > docs/configuration.md      (make docs)

tests/unit/test_config_doc.py checks that the committed page equals ``render()``.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from collections.abc import Iterable, Iterator

import annotated_types
from pydantic.fields import FieldInfo

from app.launch.cli import build_parser, is_env_only
from app.settings import Settings

ALL_ROLES = "api, engine, worker"

# Every Settings field exactly once: (heading, ((field, the roles that read it), ...)). "serve" runs all
# three roles, so a field read by any role is read by serve.
GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Model and HTTP", (
        ("model", "api, worker; engine (JSON, and the tokenizer for structured outputs)"),
        ("served_model_name", "api"),
        ("host", "api"),
        ("port", "api"),
        ("max_model_len", "api, engine"),
        ("limit_mm_per_prompt", "api"),
        ("generation_config", "api"),
        ("chat_template", "api"),
        ("tool_call_parser", "api"),
    )),
    ("Processes and sockets", (
        ("engine_addr", "api, engine"),
        ("worker_addr", "engine, worker"),
        ("api_server_count", "serve"),
        ("mm_preprocess_processes", "api"),
        ("curve_key_file", ALL_ROLES),
        ("curve_secret_key", ALL_ROLES),
        ("shutdown_timeout", ALL_ROLES),
        ("log_level", ALL_ROLES),
    )),
    ("Multimodal caches", (
        ("mm_processor_cache_gb", "api"),
        ("mm_ipc_cache_gb", "api"),
        ("mm_processor_cache_type", "api"),
        ("mm_shm_cache_max_object_size_mb", "api"),
        ("mm_uuid_cache_entries", "api"),
        ("mm_uuid_store", "api"),
        ("tenant_cache_isolation", "api"),
        ("encoder_cache_tokens", "engine"),
        ("encoder_compute_budget_tokens", "engine"),
    )),
    ("Stored responses", (
        ("responses_store_entries", "api"),
        ("responses_store_mb", "api"),
        ("responses_store", "api"),
    )),
    ("Scheduling", (
        ("max_num_seqs", "engine"),
        ("max_num_batched_tokens", "engine"),
        ("enable_prefix_caching", "engine"),
        ("prefix_match", "engine"),
        ("disable_chunked_mm_input", "engine"),
        ("max_waiting_requests", "engine"),
        ("async_scheduling", "engine"),
        ("scheduling_policy", "engine"),
        ("step_timeout_s", "engine"),
    )),
    ("Structured outputs", (
        ("structured_output_cache_mb", "engine"),
        ("structured_output_compile_timeout_s", "engine"),
        ("response_format_whitespace", "api"),
    )),
    ("Worker", (
        ("device", "worker"),
        ("block_size", "worker"),
        ("kv_cache_tokens", "worker"),
        ("gpu_memory_utilization", "worker"),
        ("worker_threads", "worker"),
        ("attention_backend", "worker"),
        ("enforce_eager", "worker"),
        ("worker_step_overlap", "worker"),
    )),
    ("Security and request limits", (
        ("api_key", "api"),
        ("max_request_body_mb", "api"),
        ("fetch_timeout_s", "api"),
        ("max_image_bytes", "api"),
        ("max_request_image_bytes", "api"),
        ("max_video_bytes", "api"),
        ("max_video_frames", "api, engine (the largest video's budget)"),
        ("max_video_pixels", "api"),
        ("video_decode_timeout_s", "api"),
        ("max_media_redirects", "api"),
        ("allow_private_media_urls", "api"),
        ("allowed_media_domains", "api"),
        ("allowed_local_media_path", "api"),
    )),
    ("Encoder-cache connector and the encoder / LM split", (
        ("ec_connector", "engine, worker"),
        ("ec_role", "engine, worker"),
        ("ec_storage_path", "engine, worker"),
        ("ec_storage_max_gb", "worker"),
        ("ec_mooncake_master", "engine, worker"),
        ("ec_mooncake_metadata_server", "engine, worker"),
        ("ec_mooncake_local_hostname", "engine, worker"),
        ("encoder_only", "worker"),
        ("language_model_only", "worker"),
    )),
)  # fmt: skip

INTRO = """\
# Configuration reference

Generated from the code by `make docs` (`python -m app.launch.config_doc`); do not edit by hand.

Every setting of `mmserve serve`, `mmserve api`, `mmserve engine` and `mmserve worker` is a command-line
flag and an `MMSERVE_*` environment variable (one secret is an environment variable only). A flag
overrides the environment, which overrides the default. Every role accepts every flag and uses the ones
it reads ("read by"; `serve` runs all three roles). `mmserve <command> --help` prints the same
descriptions and defaults; `python -m app.launch.cli` is the same program as `mmserve`.

- Invalid settings exit with status 2 and a message naming the field.
- Booleans are `--flag` / `--no-flag` on the command line, `true` / `false` in the environment.
- `--limit-mm-per-prompt` takes `image=N` or a JSON object, and so does its environment variable
  (`MMSERVE_LIMIT_MM_PER_PROMPT=image=4` or `'{"image": 4}'`). `--allowed-media-domains` takes
  `a.com,b.org` or a JSON list, in both places.
- A default of `None` means "unset": the description says what applies then.
- `mmserve serve` replaces the default `--engine-addr` and `--worker-addr` with private `ipc://` paths
  in a fresh temporary folder, so two servers never collide; an address given explicitly is used as is.
- The engine reads only JSON files of the model folder (`config.json` and the processor settings), and
  only when `--max-model-len` or an encoder budget is left to the model; and, once a request asks for
  structured output, its tokenizer (the vocabulary grammars are compiled over).
- `MMSERVE_MODEL_NAME` and `MMSERVE_BENCH_*` are read by the load-test scripts in bench/, not by
  mmserve (see [operations.md, "Load testing"](operations.md#load-testing)).
"""

_HELP = re.compile(r"(?s)(?P<description>.*) \(default: (?P<default>.*); env (?P<env>MMSERVE_\w+)\)$")
_BOUNDS = (  # pydantic's constraint type, its attribute, its sign
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def _cell(text: str) -> str:
    """Text safe in a markdown table cell (no column breaks, no stray HTML tags)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise ValueError("mmserve's parser has no subcommands")


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    return (a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction))


def _kind(field: FieldInfo) -> str:
    """The value a setting takes, from its type and bounds."""
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        kind = " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    elif origin is dict:
        kind = "modality=N"
    elif origin is list:
        kind = "list"
    else:
        kind = getattr(annotation, "__name__", str(annotation))
    bounds = [
        f"{sign} {getattr(meta, attribute)}"
        for meta in field.metadata
        for bound_type, attribute, sign in _BOUNDS
        if isinstance(meta, bound_type)
    ]
    return ", ".join([kind, *bounds])


def _settings_row(name: str, roles: str, actions: dict[str, argparse.Action]) -> str:
    field = Settings.model_fields[name]
    env = f"MMSERVE_{name.upper()}"
    if is_env_only(name):
        flag, default, description = "(environment only)", str(field.default), field.description or ""
    else:
        action = actions[name]
        match = _HELP.match(action.help or "")
        if match is None or match["env"] != env:
            raise ValueError(f"--help of {name} is not '<description> (default: ...; env {env})'")
        flag = ", ".join(f"`{option}`" for option in action.option_strings)
        default, description = match["default"], match["description"]
    cells = [flag, f"`{env}`", _kind(field), f"`{_cell(default)}`", roles, _cell(description)]
    return "| " + " | ".join(cells) + " |"


def _settings_tables(serve: argparse.ArgumentParser) -> list[str]:
    grouped = [name for _, fields in GROUPS for name, _ in fields]
    if sorted(grouped) != sorted(Settings.model_fields):
        missing = sorted(set(Settings.model_fields) - set(grouped))
        raise ValueError(f"app/launch/config_doc.py GROUPS must name every setting once; missing: {missing}")
    actions = {action.dest: action for action in _options(serve)}
    lines: list[str] = []
    for heading, fields in GROUPS:
        lines += [f"### {heading}", ""]
        lines += ["| flag | environment variable | value | default | read by | description |"]
        lines += ["|---|---|---|---|---|---|"]
        lines += [_settings_row(name, roles, actions) for name, roles in fields]
        lines.append("")
    return lines


def _command_table(parser: argparse.ArgumentParser, skip: Iterable[str] = ()) -> list[str]:
    """``skip``: the dests of options documented elsewhere (the settings flags)."""
    lines = ["| flag | value | description |", "|---|---|---|"]
    for action in _options(parser):
        if action.dest in skip:
            continue
        flags = ", ".join(f"`{option}`" for option in action.option_strings)
        if action.choices:
            value = " \\| ".join(f"`{choice}`" for choice in action.choices)
        else:
            value = f"`{action.metavar or action.dest.upper()}`"
        if action.required:
            repeatable = isinstance(action, argparse._AppendAction)
            value += " (required, repeatable)" if repeatable else " (required)"
        lines.append(f"| {flags} | {value} | {_cell(action.help or '')} |")
    return lines + [""]


def render() -> str:
    """The whole of docs/configuration.md."""
    subcommands = _subcommands(build_parser())
    commands: dict[str, argparse.ArgumentParser] = dict(subcommands.choices)
    lines = [INTRO, "## Commands", "", "| command | what it does |", "|---|---|"]
    lines += [f"| `mmserve {a.dest}` | {_cell(a.help or '')} |" for a in subcommands._choices_actions]
    lines.append("")
    lines += ["## Settings of `serve`, `api`, `engine` and `worker`", ""]
    lines += _settings_tables(commands["serve"])
    lines += ["## `mmserve proxy`", ""]
    lines += [
        'The front of an encoder / LM split (see [operations.md, "Encoder / LM split"]'
        "(operations.md#encoder--lm-split)). Flags only, no environment variables; `--host`, `--port`, "
        "`--max-request-body-mb` and `--log-level` default as an API process's settings do.",
        "",
    ]
    lines += _command_table(commands["proxy"])
    lines += ["## `mmserve ray serve`", ""]
    lines += [
        'mmserve replicas on Ray Serve behind a media-affinity router (see [operations.md, "Scale-out on '
        'Ray"](operations.md#scale-out-on-ray)). It takes every setting of `serve` above, for every replica, '
        "and these flags of its own:",
        "",
    ]
    ray_serve = dict(_subcommands(commands["ray"]).choices)["serve"]
    lines += _command_table(ray_serve, skip=Settings.model_fields)
    lines += ["## `mmserve build-tiny-model`", ""]
    lines += [
        "Writes a tiny, randomly initialised checkpoint of a family: its real config classes, processor and "
        "chat template, a locally trained tokenizer; the same seed gives the same files. No hub access.",
        "",
    ]
    lines += _command_table(commands["build-tiny-model"])
    lines += ["## `mmserve curve-keygen`", ""]
    lines += [
        "Writes a new ZeroMQ CURVE key pair as a secret certificate (mode 0600) for `--curve-key-file`; "
        'every role of one deployment uses the same file (see [operations.md, "ZeroMQ CURVE between '
        'roles"](operations.md#zeromq-curve-between-roles)).',
        "",
    ]
    lines += _command_table(commands["curve-keygen"])
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
