"""``mmserve proxy``: its settings, flags and entry point (app/proxy/server.py is the app it serves). Light on
imports, as ``mmserve``'s parser loads it for every role: the app's modules load in ``run_proxy``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import setproctitle
import uvicorn

from app.settings import setting_default

PROXY_HELP = "Start the proxy in front of encoder-only and LM instances (encoder / LM split)."
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# After SIGINT/SIGTERM uvicorn waits this long for answers still being relayed, then cuts them off.
GRACEFUL_SHUTDOWN_S = 5


@dataclass(frozen=True)
class ProxyConfig:
    """Built once by ``mmserve proxy`` (app/proxy/cli.py), or by a test; invalid values raise
    ``ValueError`` here, before anything starts."""

    encoder_urls: tuple[str, ...]
    lm_urls: tuple[str, ...]
    # the flags an API process has too default as there (app/settings.py)
    host: str = setting_default("host")
    port: int = setting_default("port")
    timeout_s: float = 300.0  # bounds the encoders' round trip and each wait for LM bytes
    max_request_body_mb: float = setting_default("max_request_body_mb")
    log_level: str = setting_default("log_level")
    health_timeout_s: float = 5.0  # per upstream /health probe

    def __post_init__(self) -> None:
        for flag, urls in (("--encoder-url", self.encoder_urls), ("--lm-url", self.lm_urls)):
            if not urls:
                raise ValueError(f"at least one {flag} is required")
            for url in urls:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise ValueError(f"{flag} {url!r} is not an http:// or https:// URL")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.timeout_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("--timeout must be positive")
        if self.max_request_body_mb <= 0:
            raise ValueError("--max-request-body-mb must be positive")

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * (1 << 20))


def add_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``proxy`` on ``mmserve``'s subcommands (``subparsers``: ``add_subparsers``' result)."""
    defaults = {field.name: field.default for field in dataclasses.fields(ProxyConfig)}
    parser: argparse.ArgumentParser = subparsers.add_parser("proxy", help=PROXY_HELP, description=PROXY_HELP)
    parser.add_argument(
        "--encoder-url",
        action="append",
        required=True,
        metavar="URL",
        help="Base URL of an encoder-only instance, e.g. http://127.0.0.1:8001; repeat for several "
        "(round-robin, one request per image).",
    )
    parser.add_argument(
        "--lm-url",
        action="append",
        required=True,
        metavar="URL",
        help="Base URL of an LM instance; repeat for several (round-robin, one per request).",
    )
    parser.add_argument("--host", default=defaults["host"], help=f"HTTP host (default: {defaults['host']}).")
    parser.add_argument(
        "--port", type=int, default=defaults["port"], help=f"HTTP port (default: {defaults['port']})."
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=defaults["timeout_s"],
        metavar="S",
        help="Seconds to wait for a request's encoders, and for each piece of an LM's answer "
        f"(default: {defaults['timeout_s']:g}).",
    )
    parser.add_argument(
        "--max-request-body-mb",
        type=float,
        default=defaults["max_request_body_mb"],
        metavar="MB",
        help="Largest request body in MiB; a larger one gets 413 before it is read "
        f"(default: {defaults['max_request_body_mb']:g}).",
    )
    parser.add_argument(
        "--log-level", default=defaults["log_level"], choices=LOG_LEVELS, help="Log level (default: info)."
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Raises ``ValueError`` for values ``ProxyConfig`` refuses."""
    return ProxyConfig(
        encoder_urls=tuple(args.encoder_url),
        lm_urls=tuple(args.lm_url),
        host=args.host,
        port=args.port,
        timeout_s=args.timeout,
        max_request_body_mb=args.max_request_body_mb,
        log_level=args.log_level,
    )


class _QuietServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Stops as uvicorn does, but does not re-raise the signal afterwards: Ctrl-C and SIGTERM both
        end in exit status 0, without a KeyboardInterrupt traceback."""
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def run_proxy(args: argparse.Namespace) -> int:
    """Serves until SIGINT or SIGTERM; the exit status of ``mmserve proxy``."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"mmserve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    setproctitle.setproctitle("mmserve: proxy")
    from app.proxy.server import create_proxy_app

    server = _QuietServer(
        uvicorn.Config(
            create_proxy_app(config),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            # h11 whatever else is installed (Ray's extra brings httptools, which uvicorn would pick)
            http="h11",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    server.run()
    # uvicorn logs why it could not start (e.g. the port is taken) and returns without serving
    return 0 if server.started else 1
