"""What the media fetch tests share: a fake resolver and a recording transport, so that nothing leaves
the machine."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

import httpx
import pytest

from app.media.url_policy import IPAddress

PARAM = "messages[0].content[0].image_url.url"
BODY = b"\x89PNG not really, the fetcher does not decode"


class FakeDNS:
    """``answers[host]``: the addresses of each lookup in turn (the last one repeats)."""

    def __init__(self, **answers: list[str] | list[list[str]]) -> None:
        self.answers = {host.replace("_", "."): a for host, a in answers.items()}
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.calls.append(host)
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        answers = self.answers[host]
        if answers and isinstance(answers[0], list):
            answer = answers[min(self.calls.count(host), len(answers)) - 1]
        else:
            answer = answers
        return [ipaddress.ip_address(a) for a in answer]


def no_dns() -> FakeDNS:
    return FakeDNS()


class Recorder:
    """A MockTransport handler that records requests; ``routes[path]`` answers, anything else fails."""

    def __init__(self, routes: dict[str, Callable[[httpx.Request], httpx.Response]] | None = None) -> None:
        self.routes = routes or {}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path not in self.routes:
            pytest.fail(f"unexpected connection: {request.method} {request.url}")
        return self.routes[request.url.path](request)
