"""``mmserve ray serve`` on a Ray cluster of this machine (127.0.0.1, object store capped): two replicas
of the tiny LLaVA behind the media-affinity router, each a whole mmserve instance.

- Six images interleaved over 60 requests: every repeat goes to the replica that served the image first
  (``x-mmserve-replica``), the encoder runs once per image across the cluster, and each answer is what
  a single server gives (the other replica's instance, asked directly, cold).
- A burst on one image past the imbalance bound spills to the other replica, answered alike.
- Streaming, auth (``/replicas`` too), the body cap, errors and the OpenAPI through the ingress as from
  ``mmserve serve``.
- ``cache_salt`` and media ids through the router; ``/tokenize`` goes where its image is held; follow-ups
  by ``previous_response_id``, and ``GET``/``DELETE`` of a stored response, go where the response was
  made, also after the ingress was killed and restarted (by the replicas' reports).
- A replica whose instance is killed: its next requests are served by the other replica, correctly, a
  media id bound there is the usual 400, and its temporary folder is gone; Ctrl-C stops every instance
  and the cluster. Every process of the cluster listens on loopback only.
- Then, on a cluster of its own that ``ray start`` made, deploy/ray-serve.yaml through ``serve run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import data_url, greedy_body, make_image, png_bytes
from tests.e2e.held_image import held_image
from tests.e2e.metrics import parse_metrics
from tests.e2e.ray_cluster import RayServer, is_loopback, listening_addresses, stop, streamed_lines, total
from tests.e2e.server import ServerProcess, alive, descendants, free_port, wait_healthy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-ray"
AUTH = {"Authorization": f"Bearer {KEY}"}
IMBALANCE = 2
BODY_CAP_MB = "1"
IMAGES = [make_image(4200 + k, size=(96, 96)) for k in range(6)]
REPORT_PERIOD_S = 2.0  # how often a replica reports its keys (RayAppArgs' default)
GATE_HOLD_S = 120  # the longest the gated image server holds its answer


@pytest.fixture(scope="module")
def ray_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    port = free_port()
    args = ["ray", "serve", "--model", str(tiny_model_dir), "--port", str(port), "--replicas", "2"]
    args += ["--replica-cpus", "0.5", "--object-store-mb", "128", "--imbalance-threshold", str(IMBALANCE)]
    args += ["--api-key", KEY, "--max-request-body-mb", BODY_CAP_MB, "--mm-preprocess-processes", "0"]
    # the drain's test holds a request on an image from a loopback server until the drain is seen
    args += ["--allow-private-media-urls", "--fetch-timeout-s", str(GATE_HOLD_S)]
    process = ServerProcess(args, tmp_path_factory.mktemp("ray-serve") / "ray-serve.log").start()
    server = RayServer(process, port, AUTH)
    try:
        wait_healthy(server.base_url, process, timeout_s=300)
        deadline = time.monotonic() + 120
        while len(server.replicas()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        yield server
    finally:
        stop(process)


def ask(server: RayServer, image_index: int, **extra: Any) -> httpx.Response:
    body = chat_body(image_index, **extra)
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def chat_body(image_index: int, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[image_index])}}]
    return greedy_body(
        [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}], max_tokens, **extra
    )


def text_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_repeats_go_to_the_replica_that_served_the_image_first(ray_server: RayServer) -> None:
    before = ray_server.replica_metrics()
    order = [k % len(IMAGES) for k in range(60)]
    served_by: dict[int, set[str]] = {}
    answers: dict[int, set[str]] = {}
    for index in order:
        resp = ask(ray_server, index)
        answers.setdefault(index, set()).add(text_of(resp))
        served_by.setdefault(index, set()).add(resp.headers["x-mmserve-replica"])
    after = ray_server.replica_metrics()
    assert all(len(replicas) == 1 for replicas in served_by.values()), served_by
    assert len({next(iter(r)) for r in served_by.values()}) == 2  # new images spread over both
    assert total(after, "mmserve_encoder_runs_total") - total(before, "mmserve_encoder_runs_total") == len(
        IMAGES
    )
    assert all(len(texts) == 1 for texts in answers.values())
    # a single server's answer: the replica that never saw the image, asked directly, cold
    replicas = ray_server.replicas()
    for index in range(len(IMAGES)):
        (owner,) = served_by[index]
        (other,) = set(replicas) - {owner}
        direct = httpx.post(
            f"{replicas[other]['url']}/v1/chat/completions", json=chat_body(index), headers=AUTH, timeout=120
        )
        assert answers[index] == {text_of(direct)}
    placements = parse_metrics(httpx.get(f"{ray_server.base_url}/metrics").text)
    assert placements.get('mmserve_ray_placements_total{placement="affinity"}', 0) >= 60 - len(IMAGES)


def test_a_burst_past_the_imbalance_bound_spills_to_the_other_replica(ray_server: RayServer) -> None:
    owner = ask(ray_server, 0).headers["x-mmserve-replica"]
    # answers long enough to overlap in the owner's queue even when the ingress sends them slowly (a
    # busy machine): six tokens each could finish one by one, never past the bound
    expected = text_of(ask(ray_server, 0, max_tokens=64))
    before = parse_metrics(httpx.get(f"{ray_server.base_url}/metrics").text)
    with ThreadPoolExecutor(16) as pool:
        burst = list(pool.map(lambda _: ask(ray_server, 0, max_tokens=64), range(16)))
    after = parse_metrics(httpx.get(f"{ray_server.base_url}/metrics").text)
    assert {text_of(resp) for resp in burst} == {expected}
    assert {resp.headers["x-mmserve-replica"] for resp in burst} - {owner}  # some went elsewhere
    name = 'mmserve_ray_placements_total{placement="fallback"}'
    assert after.get(name, 0) - before.get(name, 0) >= 1


def test_streaming_auth_and_errors_are_mmserve_serves(ray_server: RayServer) -> None:
    url = f"{ray_server.base_url}/v1/chat/completions"
    expected = text_of(ask(ray_server, 1))
    pieces = []
    with httpx.stream("POST", url, json=chat_body(1, stream=True), headers=AUTH, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        delta = json.loads(line.removeprefix("data: "))["choices"]
        pieces += [choice["delta"].get("content") or "" for choice in delta]
    assert "".join(pieces) == expected
    direct = next(iter(ray_server.replicas().values()))["url"]
    too_big = b"{" + b" " * (int(BODY_CAP_MB) << 20) + b"}"
    cases: list[tuple[dict[str, str], bytes]] = [
        ({}, b"{}"),  # no key
        ({"Authorization": "Bearer wrong"}, b"{}"),
        ({**AUTH, "Content-Type": "application/json"}, b"{not json"),
        ({**AUTH, "Content-Type": "application/json"}, b'{"model": "tiny-llava", "messages": []}'),
        ({**AUTH, "Content-Type": "application/json"}, too_big),
    ]
    for headers, body in cases:
        through = httpx.post(url, content=body, headers=headers, timeout=60)
        alone = httpx.post(f"{direct}/v1/chat/completions", content=body, headers=headers, timeout=60)
        assert (through.status_code, through.json()) == (alone.status_code, alone.json())
        assert through.status_code in (400, 401, 413, 422)
    assert httpx.get(f"{ray_server.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-llava"
    assert httpx.head(f"{ray_server.base_url}/health").status_code == 200
    assert httpx.get(f"{ray_server.base_url}/replicas").status_code == 401  # its instances' addresses
    assert "/v1/chat/completions" in httpx.get(f"{ray_server.base_url}/openapi.json").json()["paths"]


def test_cache_salt_and_media_ids_through_the_router(ray_server: RayServer) -> None:
    plain = text_of(ask(ray_server, 2))
    before = ray_server.replica_metrics()
    salted = ask(ray_server, 2, cache_salt="tenant-b")
    after = ray_server.replica_metrics()
    assert text_of(salted) == plain
    runs = "mmserve_mm_processor_seconds_count"
    assert total(after, runs) - total(before, runs) == 1  # a salted request shares no cache hit
    fresh = make_image(4299, size=(96, 96))  # sent nowhere before
    part = {"type": "image_url", "image_url": {"url": data_url(fresh)}, "uuid": "ray-doc"}
    only_id = {"type": "image_url", "image_url": None, "uuid": "ray-doc"}
    bodies = [
        greedy_body([{"role": "user", "content": [p, {"type": "text", "text": "What is it?"}]}], 6)
        for p in (part, only_id)
    ]
    url = f"{ray_server.base_url}/v1/chat/completions"
    bound = httpx.post(url, json=bodies[0], headers=AUTH, timeout=120)
    by_id = httpx.post(url, json=bodies[1], headers=AUTH, timeout=120)
    assert text_of(by_id) == text_of(bound)
    assert by_id.headers["x-mmserve-replica"] == bound.headers["x-mmserve-replica"]
    # the other replica sees the binding (one media-id table on one machine) but holds no item for it:
    # the usual 400, never a 500 or another item's answer
    replicas = ray_server.replicas()
    (other,) = set(replicas) - {bound.headers["x-mmserve-replica"]}
    direct = f"{replicas[other]['url']}/v1/chat/completions"
    elsewhere = httpx.post(direct, json=bodies[1], headers=AUTH, timeout=120)
    assert elsewhere.status_code == 400 and elsewhere.json()["error"]["code"] == "media_uuid_unknown"
    unknown = {"type": "image_url", "image_url": None, "uuid": "never-bound"}
    refused = httpx.post(
        url, json=greedy_body([{"role": "user", "content": [unknown]}], 6), headers=AUTH, timeout=120
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "media_uuid_unknown"


def responses_turn(server: RayServer, fields: dict[str, Any]) -> tuple[str, str, str]:
    """(response id, output text, replica) of one ``/v1/responses`` turn, streamed or not."""
    body = {"model": "tiny-llava", "max_output_tokens": 4, "temperature": 0, **fields}
    url = f"{server.base_url}/v1/responses"
    if not fields.get("stream"):
        resp = httpx.post(url, json=body, headers=AUTH, timeout=120)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        return answer["id"], answer["output"][0]["content"][0]["text"], resp.headers["x-mmserve-replica"]
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    done = events[-1]["response"]  # response.completed, or response.incomplete at max_output_tokens
    return done["id"], done["output"][0]["content"][0]["text"], resp.headers["x-mmserve-replica"]


def test_follow_ups_go_where_their_stored_response_was_made(ray_server: RayServer) -> None:
    image = {"type": "input_image", "image_url": data_url(make_image(4310, size=(96, 96)))}
    first = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, image]}]
    response_id, _, replica = responses_turn(ray_server, {"input": first})
    for turn in range(4):  # streamed and not: the ingress learns each new id either way
        fields = {"input": f"And then {turn}?", "previous_response_id": response_id, "stream": turn % 2 == 1}
        response_id, _, answered_by = responses_turn(ray_server, fields)
        assert answered_by == replica


def test_a_stored_response_is_read_and_deleted_where_it_was_made(ray_server: RayServer) -> None:
    """``GET``, ``DELETE``, its input items, cancellation and references to its items go to the replica
    that made the response. Here every replica reads one store file (``mmserve ray serve`` on one
    machine), so the header shows the placement; on a cluster without a shared ``--responses-store``
    each replica holds only its own, and another would 404."""
    made: dict[str, str] = {}
    for k in range(16):  # new media goes to the replica holding fewer keys: soon both hold some
        image = {"type": "input_image", "image_url": data_url(make_image(4340 + k, size=(96, 96)))}
        first = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, image]}]
        response_id, _, replica = responses_turn(ray_server, {"input": first})
        made[response_id] = replica
        if len(made) >= 4 and len(set(made.values())) == 2:
            break
    assert len(set(made.values())) == 2  # both replicas hold some
    url = f"{ray_server.base_url}/v1/responses"
    for response_id, replica in made.items():
        got = httpx.get(f"{url}/{response_id}", headers=AUTH, timeout=60)
        assert got.status_code == 200 and got.json()["id"] == response_id, got.text
        assert got.headers["x-mmserve-replica"] == replica
        # its input items, a reference to one (the id names the response), and a cancellation: there too
        items = httpx.get(f"{url}/{response_id}/input_items", headers=AUTH, timeout=60)
        reference = {"model": "tiny-llava", "max_output_tokens": 2, "store": False, "input": [{"id": ""}]}
        reference["input"][0]["id"] = items.json()["data"][0]["id"]
        referred = httpx.post(url, json=reference, headers=AUTH, timeout=60)
        cancel = httpx.post(f"{url}/{response_id}/cancel", headers=AUTH, timeout=60)
        assert [r.status_code for r in (items, referred, cancel)] == [200, 200, 400], referred.text
        assert {r.headers["x-mmserve-replica"] for r in (items, referred, cancel)} == {replica}
        gone = httpx.delete(f"{url}/{response_id}", headers=AUTH, timeout=60)
        assert gone.status_code == 200 and gone.json()["deleted"] is True, gone.text
        assert gone.headers["x-mmserve-replica"] == replica
        again = httpx.get(f"{url}/{response_id}", headers=AUTH, timeout=60)
        assert again.status_code == 404 and again.headers["x-mmserve-replica"] == replica


def test_tokenize_goes_where_its_image_is_held_and_counts_the_chat_prompt(ray_server: RayServer) -> None:
    body = chat_body(5)
    chat = ask(ray_server, 5)
    assert chat.status_code == 200, chat.text
    tokenize = {"model": body["model"], "messages": body["messages"]}
    counted = httpx.post(f"{ray_server.base_url}/tokenize", json=tokenize, headers=AUTH, timeout=120)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert counted.headers["x-mmserve-replica"] == chat.headers["x-mmserve-replica"]


def test_every_process_of_the_cluster_listens_on_loopback_only(ray_server: RayServer) -> None:
    """Ray's own servers, its HTTP proxy, the replicas' inter-deployment gRPC servers (bound to the node's
    address, 127.0.0.1 here, by app/ray_serve/grpc_binding.py) and the instances."""
    assert ray_server.process.proc is not None
    listening = listening_addresses(descendants(ray_server.process.proc.pid))
    assert f"127.0.0.1:{ray_server.port}" in listening  # the proxy: the table is read right
    assert len(listening) > 10, listening  # GCS, raylet, workers, replicas, instances
    beyond = {address: pid for address, pid in listening.items() if not is_loopback(address)}
    assert not beyond, {a: Path(f"/proc/{p}/cmdline").read_bytes()[:80] for a, p in beyond.items()}


def test_after_the_ingress_restarts_follow_ups_go_where_their_response_was_made(
    ray_server: RayServer,
) -> None:
    """The ingress's own memory of where each response was made dies with it; each replica reports the
    responses it made among its keys, so the new ingress's router sends a follow-up there, by affinity
    (a router that did not know would place each as new media, on the least loaded replica)."""
    made: dict[str, str] = {}
    # New media goes to the replica holding fewer keys, so after the module's earlier tests it may all go
    # to one replica until the two hold as many: new images until each replica has made three responses
    # (bounded; the router spreads new media, so both get there).
    for k in range(40):
        if len(set(made.values())) == 2 and min(Counter(made.values()).values()) >= 3:
            break
        image = {"type": "input_image", "image_url": data_url(make_image(4320 + k, size=(96, 96)))}
        first = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, image]}]
        response_id, _, replica = responses_turn(ray_server, {"input": first, "stream": k % 2 == 1})
        made[response_id] = replica
    assert len(set(made.values())) == 2, Counter(made.values())  # new media spreads over both replicas
    assert min(Counter(made.values()).values()) >= 3, Counter(made.values())
    time.sleep(REPORT_PERIOD_S + 1)  # every replica has reported the responses it made
    assert ray_server.process.proc is not None
    [ingress] = [
        pid
        for pid in descendants(ray_server.process.proc.pid)
        if b"MmserveIngress" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    os.kill(ingress, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray Serve starts a new ingress; its router reads the reports
        try:
            if len(ray_server.replicas()) == 2:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    else:
        raise AssertionError("the ingress did not come back")
    before = parse_metrics(httpx.get(f"{ray_server.base_url}/metrics").text)
    for response_id, replica in made.items():
        _, _, answered_by = responses_turn(
            ray_server, {"input": "And then?", "previous_response_id": response_id}
        )
        assert answered_by == replica
    after = parse_metrics(httpx.get(f"{ray_server.base_url}/metrics").text)
    for placement, count in (("affinity", len(made)), ("new", 0), ("fallback", 0)):
        name = f'mmserve_ray_placements_total{{placement="{placement}"}}'
        assert after.get(name, 0) - before.get(name, 0) == count, placement


def test_a_killed_replica_s_requests_go_to_the_other_and_sigterm_drains_then_stops_all(
    ray_server: RayServer,
) -> None:
    owners = {index: ask(ray_server, index).headers["x-mmserve-replica"] for index in range(len(IMAGES))}
    expected = {index: text_of(ask(ray_server, index)) for index in range(len(IMAGES))}
    replicas = ray_server.replicas()
    victim = owners[0]
    # a media id bound with image 0's URL: placed by that URL, on the victim
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}, "uuid": "ray-victims"}
    only_id = {"type": "image_url", "image_url": None, "uuid": "ray-victims"}
    url = f"{ray_server.base_url}/v1/chat/completions"
    bodies = [
        greedy_body([{"role": "user", "content": [p, {"type": "text", "text": "Hm?"}]}], 6)
        for p in (part, only_id)
    ]
    bound = httpx.post(url, json=bodies[0], headers=AUTH, timeout=120)
    assert bound.status_code == 200 and bound.headers["x-mmserve-replica"] == victim, bound.text
    os.killpg(replicas[victim]["pid"], signal.SIGKILL)  # the instance's whole process group
    for index in range(len(IMAGES)):
        resp = ask(ray_server, index)
        assert text_of(resp) == expected[index]
        if owners[index] == victim:
            assert resp.headers["x-mmserve-replica"] != victim
    # the binding's replica is gone: the id alone lands elsewhere and is served from a cache there that
    # holds image 0 (the requests above put it in one), or is the usual 400; never a 500 or another answer
    by_id = httpx.post(url, json=bodies[1], headers=AUTH, timeout=120)
    if by_id.status_code == 200:
        assert by_id.headers["x-mmserve-replica"] != victim and text_of(by_id) == text_of(bound)
    else:
        assert by_id.status_code == 400 and by_id.json()["error"]["code"] == "media_uuid_unknown", by_id.text
    instances = [entry["pid"] for entry in ray_server.replicas().values()]
    left = sorted(Path(tempfile.gettempdir()).glob(f"mmserve-replica-{victim}-*"))  # its log may stay
    assert all(path.suffix == ".log" for path in left), f"its instance's temporary folder stayed: {left}"

    # SIGTERM drains as `mmserve serve` does: the answer under way finishes, new requests get 503. The
    # answer is held on its image (a loopback server answers only when told), so it is surely still under
    # way when the drain is seen, however slow the machine
    lines: list[str] = []
    with held_image(png_bytes(make_image(4300)), GATE_HOLD_S) as (held_url, asked, release):
        parts = [{"type": "image_url", "image_url": {"url": held_url}}, {"type": "text", "text": "Go on."}]
        held = greedy_body([{"role": "user", "content": parts}], 40)
        streaming = threading.Thread(target=streamed_lines, args=(ray_server, held, AUTH, lines), daemon=True)
        streaming.start()
        assert asked.wait(60), "the held image was never fetched"
        assert ray_server.process.proc is not None
        ray_server.process.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{ray_server.base_url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the ingress never started draining"
            time.sleep(0.05)
        refused = ask(ray_server, 1)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert streaming.is_alive() and not lines, lines
        release.set()
        streaming.join(120)
    assert lines[-1] == "[DONE]", lines[-3:]
    choices = [json.loads(line)["choices"] for line in lines[:-1]]
    assert [c[0]["finish_reason"] for c in choices if c and c[0]["finish_reason"]] == ["length"], lines[-3:]
    assert ray_server.process.proc.wait(60) == 0, ray_server.process.log()[-3000:]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in instances) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in instances)


def test_the_serve_config_file_runs_on_a_cluster_started_apart(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """deploy/ray-serve.yaml, its node-specific values set (model, stores, port) and one replica, given to
    ``serve run`` on a cluster that ``ray start`` made (127.0.0.1, token authentication): the same
    application serves, and every process listens on loopback. Runs after the module's own cluster
    stopped, so the two never hold memory at once."""
    folder = tmp_path_factory.mktemp("ray-config")
    (folder / "token").write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the node's address is 127.0.0.1, as mmserve ray serve's
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(folder / "token"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    config = yaml.safe_load((REPO / "deploy/ray-serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    app_args = config["applications"][0]["args"]
    app_args |= {"replicas": 1, "replica_cpus": 0.5}
    app_args["settings"] |= {
        "model": str(tiny_model_dir),
        "mm_uuid_store": str(folder / "media-ids.sqlite"),
        "responses_store": str(folder / "responses.sqlite"),
        "mm_preprocess_processes": 0,
    }
    (folder / "ray-serve.yaml").write_text(yaml.safe_dump(config))
    bin_dir = Path(sys.executable).parent
    head_args = ["start", "--head", "--block", "--port", "0", "--node-ip-address", "127.0.0.1"]
    head_args += ["--num-cpus", "2", "--object-store-memory", str(128 << 20), "--include-dashboard", "false"]
    # Ray's socket paths must fit in 107 bytes: its folder is a short one under /tmp, not pytest's
    ray_dir = Path(tempfile.mkdtemp(prefix="mmserve-ray-"))
    head_args += ["--temp-dir", str(ray_dir), "--disable-usage-stats"]
    with (folder / "head.log").open("wb") as log:
        head = subprocess.Popen(
            [str(bin_dir / "ray"), *head_args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        address_file = ray_dir / "ray_current_cluster"
        deadline = time.monotonic() + 120
        while not address_file.exists() and time.monotonic() < deadline:
            assert head.poll() is None, (folder / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        address = address_file.read_text().strip()
        deployed = subprocess.run(
            [
                str(bin_dir / "serve"),
                "run",
                str(folder / "ray-serve.yaml"),
                "--address",
                address,
                "--non-blocking",
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the replica's instance starts
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                listed = httpx.get(f"{base}/replicas", timeout=10).json()["replicas"]
                if any("url" in entry for entry in listed):
                    break
            time.sleep(1)
        models = httpx.get(f"{base}/v1/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-llava", models.text
        answers = [
            httpx.post(f"{base}/v1/chat/completions", json=chat_body(1), timeout=120) for _ in range(2)
        ]
        assert text_of(answers[0]) == text_of(answers[1])
        assert answers[0].headers["x-mmserve-replica"] == answers[1].headers["x-mmserve-replica"]
        listening = listening_addresses(descendants(head.pid))
        assert f"127.0.0.1:{port}" in listening
        assert all(is_loopback(address) for address in listening), listening
    finally:
        processes = descendants(head.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)  # ray start --block stops the cluster it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        for pid in processes:  # anything that outlived it (Ray's processes make their own groups)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
