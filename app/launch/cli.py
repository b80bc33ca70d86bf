"""``mmserve`` command line: one subcommand per role, flags generated from ``Settings`` so every knob
is a flag (``--max-num-seqs``) and an environment variable (``MMSERVE_MAX_NUM_SEQS``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from app.launch.ray_cli import add_ray_parser, run_ray_serve
from app.proxy.cli import add_proxy_parser, run_proxy
from app.settings import Settings
from workers.families.tiny import TINY_FAMILIES

ROLES = {
    "serve": "Start the API, engine and worker processes locally (Ctrl-C stops all three).",
    "api": "Start only the HTTP API process (connects to --engine-addr).",
    "engine": "Start only the engine process (binds --engine-addr and --worker-addr).",
    "worker": "Start only a model worker (connects to --worker-addr).",
}


REPEATABLE = {"api_key"}  # settings whose flag may be given several times (a list)


def is_env_only(name: str) -> bool:
    """A setting read from its environment variable only (a secret: a flag would show in ``ps``)."""
    extra = Settings.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("env_only"))


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        if is_env_only(name):
            continue
        flag = "--" + name.replace("_", "-")
        default = "model's own limit" if name == "max_model_len" else field.default
        if name == "limit_mm_per_prompt":
            default = ",".join(f"{k}={v}" for k, v in field.default.items())
        if name in REPEATABLE:
            default = "none"
        help_text = f"{field.description} (default: {default}; env MMSERVE_{name.upper()})"
        if field.annotation is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, dest=name, default=None, action=action, help=help_text)
        elif name in REPEATABLE:
            metavar = name.split("_")[-1].upper()
            parser.add_argument(
                flag, dest=name, default=None, action="append", metavar=metavar, help=help_text
            )
        else:
            metavar = name.split("_")[-1].upper()
            parser.add_argument(flag, dest=name, default=None, metavar=metavar, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve", description="OpenAI-compatible server for vision-language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for role, help_text in ROLES.items():
        _add_settings_flags(sub.add_parser(role, help=help_text, description=help_text))
    add_proxy_parser(sub)
    add_ray_parser(sub, _add_settings_flags)
    tiny = sub.add_parser("build-tiny-model", help="Build a tiny random checkpoint for tests and demos.")
    tiny.add_argument(
        "--family", choices=list(TINY_FAMILIES), default="llava", help="Model family (default: llava)."
    )
    tiny.add_argument("--out", required=True, help="Output folder (created or overwritten).")
    tiny.add_argument("--seed", type=int, default=0, help="Weight seed; same seed, same files (default: 0).")
    keygen = sub.add_parser(
        "curve-keygen",
        help="Write a new ZeroMQ CURVE key pair for --curve-key-file (every role of a deployment shares it).",
    )
    keygen.add_argument(
        "--out", required=True, help="The secret certificate's path (written with mode 0600)."
    )
    return parser


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags given on the command line."""
    return {
        name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None
    }


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given on the command line override MMSERVE_* variables, which override defaults."""
    return Settings(**given_settings(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "proxy":
        return run_proxy(args)
    if args.command == "ray":
        return run_ray_serve(args, given_settings(args))
    if args.command == "build-tiny-model":
        from workers.families.tiny import build_tiny_model

        path = build_tiny_model(args.family, args.out, seed=args.seed)
        print(f"mmserve: built tiny {args.family} model in {path}")
        return 0
    if args.command == "curve-keygen":
        from wire.curve import write_key_file

        keys = write_key_file(args.out)
        print(f"mmserve: wrote a CURVE key pair to {args.out} (public key {keys.public.decode()})")
        return 0
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"mmserve: error: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    from app.launch import launcher

    return launcher.run_role(args.command, settings)


if __name__ == "__main__":
    sys.exit(main())
