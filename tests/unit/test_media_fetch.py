"""The media fetcher under its policy: a fake resolver stands in for DNS and ``httpx.MockTransport`` for
the network (it fails the test when a refused URL would have connected); a real HTTP server on loopback
shows the connection, Host header, byte caps and timeouts. No traffic leaves 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import shutil
import ssl
import subprocess
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.schemas import ChatMessageParam
from app.errors import MediaError
from app.inputs.input_processor import InputProcessor
from app.media.fetch import MediaFetcher
from app.media.url_policy import IPAddress, MediaPolicy
from app.metrics import ApiMetrics
from app.settings import Settings
from tests.unit.fetch_support import BODY, PARAM, FakeDNS, Recorder, no_dns
from tests.unit.input_support import prepare_only_family

PUBLIC = "93.184.215.14"
PRIVATE_POLICY = MediaPolicy(allow_private_addresses=True)
DEFAULT_POLICY = MediaPolicy()


def redirect(location: str, status: int = 302) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _request: httpx.Response(status, headers={"Location": location})


class Streamed(httpx.AsyncByteStream):
    """A body that arrives as a stream, as from a socket (``content=`` would be read eagerly)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.body


def ok(body: bytes = BODY) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _request: httpx.Response(200, stream=Streamed(body))


def fetch(
    url: str,
    resolver: FakeDNS,
    transport: httpx.AsyncBaseTransport | Recorder | None = None,
    policy: MediaPolicy = DEFAULT_POLICY,
) -> bytes:
    if isinstance(transport, Recorder):
        transport = httpx.MockTransport(transport)

    async def main() -> bytes:
        async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
            return await MediaFetcher(policy, client, resolver).fetch_http(url, param=PARAM)

    return asyncio.run(main())


def fetch_error(url: str, resolver: FakeDNS, transport: Any = None, **kwargs: Any) -> MediaError:
    with pytest.raises(MediaError) as info:
        fetch(url, resolver, transport, **kwargs)
    assert (info.value.param, info.value.http_status) == (PARAM, 400)
    return info.value


# -- refusal after DNS, before any connection -----------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        ["10.0.0.1"],
        [PUBLIC, "10.0.0.1"],  # one bad answer is enough: no picking of the good one
        ["10.0.0.1", PUBLIC],
        ["127.0.0.1"],
        ["169.254.169.254"],
        ["::ffff:10.0.0.1"],
        ["2606:4700::1", "fd00::1"],
        ["::1"],
    ],
)
def test_a_name_with_any_non_public_address_is_refused_before_connecting(answer: list[str]) -> None:
    dns, network = FakeDNS(evil_test=answer), Recorder()
    started = time.monotonic()
    err = fetch_error("http://evil.test/x.png", dns, network)
    assert time.monotonic() - started < 5.0  # no connect attempt waited on
    assert err.code == "image_url_forbidden" and "--allow-private-media-urls" in err.message
    assert dns.calls == ["evil.test"] and network.requests == []
    for address in answer:
        assert address not in err.message


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/x", "http://[::ffff:127.0.0.1]/", "http://2130706433/", "http://10.1/"]
)
def test_an_address_literal_is_refused_without_dns_or_connection(url: str) -> None:
    dns, network = no_dns(), Recorder()
    assert fetch_error(url, dns, network).code == "image_url_forbidden"
    assert dns.calls == [] and network.requests == []


def test_unknown_and_addressless_names_are_fetch_failures() -> None:
    assert fetch_error("http://nowhere.test/x", no_dns(), Recorder()).code == "image_fetch_failed"
    assert fetch_error("http://empty.test/x", FakeDNS(empty_test=[]), Recorder()).code == "image_fetch_failed"


def test_allow_private_fetches_a_private_answer() -> None:
    network = Recorder({"/x.png": ok()})
    assert fetch("http://evil.test/x.png", FakeDNS(evil_test=["10.0.0.1"]), network, PRIVATE_POLICY) == BODY
    assert network.requests[0].url.host == "10.0.0.1"


# -- the request goes to the validated address, named as the URL named it ---------------------------


def test_http_request_goes_to_the_validated_address_with_the_original_host() -> None:
    network = Recorder({"/a.png": ok()})
    assert fetch("http://Images.test/a.png?size=1", FakeDNS(images_test=[PUBLIC]), network) == BODY
    (request,) = network.requests
    assert (request.url.scheme, request.url.host, request.url.port) == ("http", PUBLIC, None)
    assert (request.url.path, request.url.query) == ("/a.png", b"size=1")
    assert request.headers["host"] == "images.test"
    assert request.headers["accept-encoding"] == "identity"
    assert "sni_hostname" not in request.extensions


def test_https_keeps_the_name_for_sni_and_the_certificate() -> None:
    network = Recorder({"/a.png": ok()})
    dns = FakeDNS(images_test=["2606:4700::1111"])
    assert fetch("https://images.test:8443/a.png", dns, network) == BODY
    (request,) = network.requests
    assert (request.url.scheme, request.url.host, request.url.port) == ("https", "2606:4700::1111", 8443)
    assert request.headers["host"] == "images.test:8443"
    assert request.extensions["sni_hostname"] == "images.test"
    assert request.headers["connection"] == "close"  # pooled connections are keyed by address only


def test_an_answer_that_changes_between_hops_is_checked_again() -> None:
    """DNS rebinding: each hop resolves once and connects where that answer pointed; a later private
    answer is refused, never connected to."""
    dns = FakeDNS(images_test=[[PUBLIC], ["10.0.0.1"]])
    network = Recorder({"/a.png": redirect("/b.png"), "/b.png": ok()})
    assert fetch_error("http://images.test/a.png", dns, network).code == "image_url_forbidden"
    assert dns.calls == ["images.test", "images.test"]
    assert [r.url.host for r in network.requests] == [PUBLIC]


# -- redirects ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "location",
    [
        "http://127.0.0.1:8080/x.png",
        "http://[::ffff:7f00:1]/x.png",
        "http://0x7f000001/x.png",
        "http://internal.test/x.png",
        "file:///etc/passwd",
        "ftp://images.test/x.png",
        "data:image/png;base64,AAAA",  # (no "//": httpx itself cannot read it as a URL)
        "mailto:someone@images.test",
    ],
)
def test_a_redirect_to_a_refused_url_is_refused(location: str, tmp_path: Path) -> None:
    dns = FakeDNS(images_test=[PUBLIC], internal_test=["192.168.0.10"])
    network = Recorder({"/a.png": redirect(location)})
    policy = MediaPolicy(local_media_root=tmp_path)  # file:// is never a redirect target
    err = fetch_error("http://images.test/a.png", dns, network, policy=policy)
    assert err.code == "image_url_forbidden"
    assert len(network.requests) == 1


def test_redirects_stay_inside_the_allowed_domains() -> None:
    dns = FakeDNS(cdn_example_com=[PUBLIC], other_org=[PUBLIC])
    policy = MediaPolicy(allowed_domains=("example.com",))
    network = Recorder({"/a.png": redirect("https://other.org/a.png"), "/b.png": ok()})
    err = fetch_error("http://cdn.example.com/a.png", dns, network, policy=policy)
    assert err.code == "image_url_forbidden" and "--allowed-media-domains" in err.message
    assert dns.calls == ["cdn.example.com"]


def test_relative_and_cross_host_redirects_are_followed() -> None:
    dns = FakeDNS(images_test=[PUBLIC], cdn_images_test=["2606:4700::1111"])
    network = Recorder(
        {
            "/dir/a.png": redirect("../b/c.png?q=1", 301),
            "/b/c.png": redirect("https://cdn.images.test/final.png", 307),
            "/final.png": ok(),
        }
    )
    assert fetch("http://images.test/dir/a.png", dns, network) == BODY
    hosts = [(r.url.host, r.headers["host"], r.extensions.get("sni_hostname")) for r in network.requests]
    assert hosts == [
        (PUBLIC, "images.test", None),
        (PUBLIC, "images.test", None),
        ("2606:4700::1111", "cdn.images.test", "cdn.images.test"),
    ]
    assert network.requests[1].url.query == b"q=1"


@pytest.mark.parametrize("max_redirects", [0, 1, 3])
def test_at_most_max_redirects_are_followed(max_redirects: int) -> None:
    routes = {f"/r{i}": redirect(f"/r{i + 1}") for i in range(10)}
    network = Recorder(routes)
    policy = MediaPolicy(max_redirects=max_redirects)
    err = fetch_error("http://images.test/r0", FakeDNS(images_test=[PUBLIC]), network, policy=policy)
    assert err.code == "too_many_redirects" and "--max-media-redirects" in err.message
    assert len(network.requests) == max_redirects + 1
    routes[f"/r{max_redirects}"] = ok()
    assert fetch("http://images.test/r0", FakeDNS(images_test=[PUBLIC]), Recorder(routes), policy) == BODY


def test_http_errors_and_a_redirect_without_location_are_fetch_failures() -> None:
    network = Recorder({"/gone": lambda _r: httpx.Response(404), "/bare": lambda _r: httpx.Response(302)})
    dns = FakeDNS(images_test=[PUBLIC])
    assert fetch_error("http://images.test/gone", dns, network).code == "image_fetch_failed"
    assert fetch_error("http://images.test/bare", dns, network).code == "image_fetch_failed"


def encoded(body: bytes, encoding: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _request: httpx.Response(200, headers={"Content-Encoding": encoding}, stream=Streamed(body))


def test_a_body_sent_compressed_is_read_decompressed_within_the_cap() -> None:
    """Asked for ``identity``, a store may still send what it holds gzip-encoded: it is decoded, and a
    small body that would decompress past the cap stops there."""
    deflated, raw = zlib.compressobj(wbits=zlib.MAX_WBITS), zlib.compressobj(wbits=-zlib.MAX_WBITS)
    network = Recorder(
        {
            "/gz": encoded(gzip.compress(BODY), "gzip"),
            "/deflate": encoded(deflated.compress(BODY) + deflated.flush(), "deflate"),
            "/raw-deflate": encoded(raw.compress(BODY) + raw.flush(), "deflate"),  # (no zlib header)
            "/bomb": encoded(gzip.compress(bytes(50 << 20)), "gzip"),  # 50 MiB of zeros in ~50 KB
            "/br": encoded(b"\x0b\x02\x80hi\x03", "br"),
            "/broken": encoded(b"not gzip at all", "gzip"),
        }
    )
    dns = FakeDNS(images_test=[PUBLIC])
    assert fetch("http://images.test/gz", dns, network) == BODY
    assert fetch("http://images.test/deflate", dns, network) == BODY
    assert fetch("http://images.test/raw-deflate", dns, network) == BODY
    small = MediaPolicy(max_image_bytes=1 << 20)
    assert fetch_error("http://images.test/bomb", dns, network, policy=small).code == "image_too_large"
    assert "Content-Encoding 'br'" in fetch_error("http://images.test/br", dns, network).message
    assert fetch_error("http://images.test/broken", dns, network).code == "invalid_image"


# -- a real server on loopback: connection, Host header, byte caps, timeouts -----------------------


class _Handler(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str]] = []  # (local address, Host header, path)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.seen.append((self.connection.getsockname()[0], self.headers["Host"], self.path))
        try:
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)
            elif self.path == "/forever":  # no Content-Length, never ends
                self.send_response(200)
                self.end_headers()
                while True:
                    self.wfile.write(b"\0" * 65536)
            elif self.path == "/drip":  # a byte at a time, each in time, never done
                self.send_response(200)
                self.end_headers()
                while True:
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.02)
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up, as intended


@pytest.fixture(scope="module")
def loopback_server() -> Iterator[int]:
    """Listens on 127.0.0.2 only, so a request that reaches it went to the address the resolver gave."""
    httpd = ThreadingHTTPServer(("127.0.0.2", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def test_a_real_connection_goes_to_the_resolved_address_with_the_name_as_host(loopback_server: int) -> None:
    _Handler.seen.clear()
    dns = FakeDNS(images_test=["127.0.0.2"])
    assert fetch(f"http://images.test:{loopback_server}/img.png", dns, policy=PRIVATE_POLICY) == BODY
    assert _Handler.seen == [("127.0.0.2", f"images.test:{loopback_server}", "/img.png")]


def test_the_default_policy_never_reaches_the_loopback_server(loopback_server: int) -> None:
    _Handler.seen.clear()
    dns = FakeDNS(images_test=["127.0.0.2"])
    started = time.monotonic()
    for url in (
        f"http://images.test:{loopback_server}/img.png",
        f"http://127.0.0.2:{loopback_server}/img.png",
    ):
        assert fetch_error(url, dns).code == "image_url_forbidden"
    assert time.monotonic() - started < 5.0
    assert _Handler.seen == []


def test_an_endless_body_is_cut_off_at_the_byte_cap(loopback_server: int) -> None:
    policy = MediaPolicy(allow_private_addresses=True, max_image_bytes=256 * 1024, timeout_s=10)
    started = time.monotonic()
    err = fetch_error(f"http://127.0.0.2:{loopback_server}/forever", no_dns(), policy=policy)
    assert err.code == "image_too_large" and time.monotonic() - started < 5.0  # not the 10 s timeout


def test_a_slow_drip_is_bounded_by_the_total_timeout(loopback_server: int) -> None:
    policy = MediaPolicy(allow_private_addresses=True, timeout_s=0.3)
    started = time.monotonic()
    err = fetch_error(f"http://127.0.0.2:{loopback_server}/drip", no_dns(), policy=policy)
    assert err.code == "image_fetch_failed" and "timed out" in err.message
    assert time.monotonic() - started < 5.0  # the body never ends: only the total timeout ends it


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, list[str | None]]]:
    """https on 127.0.0.2 with a self-signed certificate for ``images.test``; records each SNI name."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=images.test"]
        + ["-addext", "subjectAltName=DNS:images.test"],
        check=True,
        capture_output=True,
    )
    names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)  # type: ignore[assignment,func-returns-value]
    httpd = ThreadingHTTPServer(("127.0.0.2", 0), _Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield int(httpd.server_address[1]), cert, names
    httpd.shutdown()
    httpd.server_close()


def test_https_to_the_pinned_address_verifies_the_certificate_for_the_name(
    tls_server: tuple[int, Path, list[str | None]],
) -> None:
    port, cert, names = tls_server
    trust = ssl.create_default_context(cafile=str(cert))
    dns = FakeDNS(images_test=["127.0.0.2"], other_test=["127.0.0.2"])
    names.clear()
    _Handler.seen.clear()

    async def get(url: str) -> bytes:
        async with httpx.AsyncClient(verify=trust, trust_env=False) as client:
            return await MediaFetcher(PRIVATE_POLICY, client, dns).fetch_http(url, param=PARAM)

    assert asyncio.run(get(f"https://images.test:{port}/img.png")) == BODY
    assert names == ["images.test"]
    assert _Handler.seen == [("127.0.0.2", f"images.test:{port}", "/img.png")]
    # Same address, another name: the certificate is checked against the name, so this fails.
    with pytest.raises(MediaError) as info:
        asyncio.run(get(f"https://other.test:{port}/img.png"))
    assert info.value.code == "image_fetch_failed" and "certificate" in info.value.message.lower()


def test_a_slow_resolver_counts_against_the_timeout() -> None:
    async def slow(host: str, port: int) -> list[IPAddress]:
        await asyncio.sleep(30)
        return [ipaddress.ip_address(PUBLIC)]

    policy = MediaPolicy(timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(MediaError) as info:
        asyncio.run(_fetch_with(policy, slow, "http://slow.test/x"))
    assert info.value.code == "image_fetch_failed" and time.monotonic() - started < 5.0  # not the 30 s answer


async def _fetch_with(policy: MediaPolicy, resolver: Any, url: str) -> bytes:
    async with httpx.AsyncClient(transport=httpx.MockTransport(Recorder()), trust_env=False) as client:
        return await MediaFetcher(policy, client, resolver).fetch_http(url, param=PARAM)


# -- the request-wide cap -------------------------------------------------------------------------


def image_message(*urls: str) -> ChatMessageParam:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatMessageParam.model_validate(
        {"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}
    )


def prepare(settings: Settings, fetcher_policy: MediaPolicy, *urls: str) -> Any:
    """Stage 2 of a real ``InputProcessor``; the family, caches and engine are not reached."""
    family = prepare_only_family(lambda kwargs: {})

    async def main() -> Any:
        async with httpx.AsyncClient(trust_env=False) as client:
            media = MediaFetcher(fetcher_policy, client, no_dns())
            inputs = InputProcessor(settings, family, None, None, ApiMetrics(), media, None)  # type: ignore[arg-type]
            return await inputs.prepare([image_message(*urls)], {})

    return asyncio.run(main())


def data_url(num_bytes: int) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(b"\1" * num_bytes).decode()


def test_the_request_wide_cap_counts_all_images_together() -> None:
    urls = [data_url(400)] * 3
    settings = Settings(max_request_image_bytes=1200)
    assert len(prepare(settings, MediaPolicy(), *urls).items) == 3
    with pytest.raises(MediaError) as info:
        prepare(Settings(max_request_image_bytes=1199), MediaPolicy(), *urls)
    err = info.value
    assert (err.code, err.param, err.http_status) == ("request_images_too_large", "messages", 400)
    assert "--max-request-image-bytes" in err.message


def test_the_request_wide_cap_stops_concurrent_streams_as_soon_as_it_is_passed(
    loopback_server: int,
) -> None:
    """Two endless bodies, each under its own 50 MiB cap: their running sum trips the 1 MiB request cap."""
    policy = MediaPolicy(allow_private_addresses=True, max_image_bytes=50 << 20, timeout_s=10)
    url = f"http://127.0.0.2:{loopback_server}/forever"
    started = time.monotonic()
    with pytest.raises(MediaError) as info:
        prepare(Settings(max_request_image_bytes=1 << 20), policy, url, url)
    assert info.value.code == "request_images_too_large" and time.monotonic() - started < 5.0
