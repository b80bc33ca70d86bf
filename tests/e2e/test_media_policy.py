"""The media-fetch policy on a real server: loopback image URLs, in any spelling, get 400
``image_url_forbidden`` at once (no fetch); ``file://`` works only under ``--allowed-local-media-path``;
and, in a private network namespace, a server on a private address is refused by default and fetched with
``--allow-private-media-urls``. No traffic leaves this machine's loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import make_image, png_bytes
from tests.e2e.server import REPO, Server, serving

pytestmark = pytest.mark.slow

PARAM = "messages[0].content[1].image_url.url"


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("media")
    (base / "images").mkdir()
    (base / "images" / "cat.png").write_bytes(png_bytes(make_image(71)))
    (base / "outside.png").write_bytes(png_bytes(make_image(72)))
    return base / "images"


@pytest.fixture(scope="module")
def policy_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, media_root: Path
) -> Iterator[Server]:
    """Default media policy (loopback refused), plus file:// under ``media_root``."""
    with serving(
        tiny_model_dir, tmp_path_factory.mktemp("policy"), "--allowed-local-media-path", str(media_root)
    ) as srv:
        yield srv


def chat(server: Server, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def assert_forbidden(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "image_url_forbidden",
        PARAM,
        "invalid_request_error",
    )
    return dict(error)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/img1.png",
        "http://[::ffff:127.0.0.1]:{port}/img1.png",
        "http://2130706433:{port}/img1.png",
        "http://0x7f000001:{port}/img1.png",
        "http://0177.0.0.1:{port}/img1.png",
        "http://127.1:{port}/img1.png",
        "http://[::1]:{port}/img1.png",
        "http://0.0.0.0:{port}/img1.png",
        "http://localhost:{port}/img1.png",  # through the system resolver
    ],
)
def test_loopback_urls_are_refused_at_once(
    policy_server: Server, server: Server, image_http_server: str, url: str
) -> None:
    url = url.format(port=image_http_server.rsplit(":", 1)[1])
    started = time.monotonic()
    error = assert_forbidden(chat(policy_server, url))
    assert time.monotonic() - started < 5.0  # no connection attempt waited on (the fetch timeout is 10 s)
    assert "--allow-private-media-urls" in error["message"]
    if url.startswith("http://127.0.0.1:"):  # the same URL is fetched where the flag is on
        assert chat(server, url).status_code == 200


def test_file_urls_only_inside_the_allowed_folder(
    policy_server: Server, server: Server, media_root: Path
) -> None:
    assert chat(policy_server, f"file://{media_root}/cat.png").status_code == 200
    assert_forbidden(chat(policy_server, f"file://{media_root}/../outside.png"))
    error = assert_forbidden(chat(server, f"file://{media_root}/cat.png"))  # flag unset there
    assert "--allowed-local-media-path" in error["message"]


# -- a private address inside a network namespace -----------------------------------------------------

PRIVATE_ADDRESS = "10.255.0.1"

# Runs inside the namespace: an image server on PRIVATE_ADDRESS, then a default server and one with
# --allow-private-media-urls asked for the same image; prints what each answered and the image hits.
NETNS_SCRIPT = """
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
import httpx
from tests.e2e.server import serving

body, hits = Path(sys.argv[4]).read_bytes(), []
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        hits.append(self.path)
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
httpd = ThreadingHTTPServer((sys.argv[3], 0), Handler)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
url = f"http://{sys.argv[3]}:{httpd.server_address[1]}/img.png"
content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
request = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
results = {}
for name, flags in (("default", ()), ("allow", ("--allow-private-media-urls",))):
    with serving(Path(sys.argv[1]), Path(sys.argv[2]), *flags) as server:
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=request, timeout=60)
        code = resp.json().get("error", {}).get("code") if resp.status_code != 200 else None
        results[name] = {"status": resp.status_code, "code": code, "hits": len(hits)}
print("RESULT " + json.dumps(results))
"""


def netns_prefix() -> list[str] | None:
    """``unshare`` into a fresh network namespace (a user namespace too when not root), or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    setup = f"ip link set lo up && ip addr add {PRIVATE_ADDRESS}/32 dev lo"
    try:
        probe = subprocess.run([*prefix, "sh", "-c", setup], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if probe.returncode == 0 else None


def test_a_private_address_in_a_network_namespace(tiny_model_dir: Path, tmp_path: Path) -> None:
    prefix = netns_prefix()
    if prefix is None:
        pytest.skip("cannot create a network namespace here (unshare -n / ip addr add not permitted)")
    setup = f'ip link set lo up && ip addr add {PRIVATE_ADDRESS}/32 dev lo && exec "$@"'
    image = tmp_path / "img.png"
    image.write_bytes(png_bytes(make_image(73)))  # made here: the script imports no torch
    argv = [
        sys.executable,
        "-c",
        NETNS_SCRIPT,
        str(tiny_model_dir),
        str(tmp_path),
        PRIVATE_ADDRESS,
        str(image),
    ]
    proc = subprocess.run(
        [*prefix, "sh", "-c", setup, "sh", *argv], cwd=REPO, capture_output=True, text=True, timeout=400
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULT "))
    assert results["default"] == {"status": 400, "code": "image_url_forbidden", "hits": 0}
    assert results["allow"] == {"status": 200, "code": None, "hits": 1}
