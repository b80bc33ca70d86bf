"""The shared-memory object store (``--mm-processor-cache-type shm``) against the lru caches and no caches
at all, on real processes: the same greedy answers for a request sequence that forces evictions, with
one and with two API processes; nothing left in /dev/shm after a stop or a SIGKILL of the whole group,
and no preprocessing process after a stop; a stale reference re-sent with its payload; a slow image
holds back no cache hit."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.server import (
    DEV_SHM,
    Server,
    alive,
    cpu_ticks,
    descendants,
    named_semaphores,
    owned_shm_entries,
    process_title,
    role_pid,
    serving,
    start_serve,
    wait_api_processes,
)

pytestmark = pytest.mark.slow

PREPROCESS = "mmserve: preprocess"
# A LLaVA item (1x3x336x336 float32) is 1.35 MB: a 4 MiB ring or cache holds three of them.
SMALL = ("--mm-processor-cache-gb", "0.004", "--mm-ipc-cache-gb", "0.004")
SHM = ("--mm-processor-cache-type", "shm", "--mm-shm-cache-max-object-size-mb", "2")
COMMON = ("--max-model-len", "2048", "--mm-preprocess-processes", "1")

IMAGES = [make_image(300 + i, (320 + 16 * i, 240)) for i in range(6)]
A, B, C, D, E, F = IMAGES
# Six distinct items through room for three: every cache evicts, some items come back after eviction.
SEQUENCE: list[list[Any]] = [
    [A],
    [B, C],
    [D],
    [A],
    [E, F],
    [B],
    [A, A],
    [C, D],
    [F],
    [A, E],
]


def body(index: int, images: list[Any]) -> dict[str, Any]:
    return greedy_body([user_message(f"Request {index}: describe.", *images)], 8)


async def run_sequence(server: Server, *, concurrency: int) -> list[str]:
    """The sequence's answers in order; ``concurrency`` requests at a time, each on a new connection
    (so the kernel spreads them over API processes)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int, images: list[Any]) -> str:
        async with limit, httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            resp = await client.post("/v1/chat/completions", json=body(index, images))
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])

    return list(await asyncio.gather(*(one(i, images) for i, images in enumerate(SEQUENCE))))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def baseline(uncached_server: Server) -> list[str]:
    """Every cache off (the session's uncached server: 2,048 tokens and one preprocessing process, as
    COMMON): what each request must answer."""
    return asyncio.run(run_sequence(uncached_server, concurrency=1))


@contextmanager
def sequence_server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, log_dir: Path, flags: tuple[str, ...], api: int
) -> Iterator[tuple[Server, bool]]:
    """The server a case runs on, and whether it stops when the block ends: one API process with the
    ring is the module's ``shm_server`` (the tests below use it too; the SIGKILL test's second start
    checks that such a server removes its ring when it stops)."""
    if flags == SMALL + SHM and api == 1:
        yield request.getfixturevalue("shm_server"), False
        return
    with serving(tiny_model_dir, log_dir, *COMMON, *flags, "--api-server-count", str(api)) as server:
        wait_api_processes(server, api)  # /health answered by one of them says nothing of the others
        yield server, True


@pytest.mark.parametrize(
    ("flags", "api_servers"),
    [(SMALL, 1), (SMALL + SHM, 1), (SMALL, 2), (SMALL + SHM, 2)],
    ids=["lru-1api", "shm-1api", "lru-2api", "shm-2api"],
)
def test_same_answers_as_without_caches(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    log_dir: Path,
    baseline: list[str],
    flags: tuple[str, ...],
    api_servers: int,
) -> None:
    with sequence_server(request, tiny_model_dir, log_dir, flags, api_servers) as (server, stops):
        start = server.metrics()
        assert asyncio.run(run_sequence(server, concurrency=1)) == baseline
        assert asyncio.run(run_sequence(server, concurrency=4)) == baseline
        metrics = server.metrics()
        assert server.process.proc is not None
        # images were processed: each API process's pool, which loads in the background, has loaded
        # (and titled itself)
        pids = [server.process.proc.pid, *descendants(server.process.proc.pid)]
        pool = [pid for pid in pids if process_title(pid) == PREPROCESS]
    assert len(pool) == api_servers  # COMMON: one preprocessing process per API process
    assert len(set(baseline)) >= 6  # the requests really differ
    assert delta(start, metrics, "mmserve_mm_ipc_cache_resends_total") == 0
    assert delta(start, metrics, "mmserve_mm_shm_stale_refs_total") == 0
    assert delta(start, metrics, "mmserve_mm_items_total") == 2 * sum(len(images) for images in SEQUENCE)
    if "shm" in flags:
        assert metrics["mmserve_mm_shm_bytes_total"] > 0
        assert metrics["mmserve_mm_ipc_cache_hits_total"] > 0  # items crossed as references
    if stops:
        assert not owned_shm_entries(pids)  # the rings were removed at the stop
        assert not any(alive(pid) for pid in pool)  # and the pool processes ended with the server


def ring_files(root_pid: int) -> list[Path]:
    pids = [root_pid, *descendants(root_pid)]
    api_pids = {pid for pid in pids if process_title(pid) == "mmserve: api"}
    return [path for path in DEV_SHM.glob("mmserve.*.ring-*") if int(path.name.split(".")[1]) in api_pids]


@pytest.fixture(scope="module")
def shm_server(tiny_model_dir: Path, log_dir: Path) -> Iterator[Server]:
    with serving(tiny_model_dir, log_dir, *COMMON, *SMALL, *SHM) as server:
        yield server


def test_salts_and_media_ids_through_the_ring(shm_server: Server) -> None:
    """Another cache_salt is another ring entry (no hit, written again); a media id sent alone is
    served from the ring."""
    server = shm_server
    url = f"{server.base_url}/v1/chat/completions"

    def ask(part: dict[str, Any], **extra: Any) -> str:
        message = {"role": "user", "content": [part, {"type": "text", "text": "Which?"}]}
        resp = httpx.post(url, json=greedy_body([message], 8, **extra), timeout=120)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])

    with_media = {**user_message("", E)["content"][0], "uuid": "e"}
    first = ask(with_media, cache_salt="one")
    before = server.metrics()
    assert ask(with_media, cache_salt="one") == first
    middle = server.metrics()
    assert ask(with_media, cache_salt="two") == first
    after = server.metrics()
    assert delta(before, middle, "mmserve_mm_ipc_cache_hits_total") == 1  # a ring hit
    assert delta(before, middle, "mmserve_mm_shm_bytes_total") == 0
    assert delta(middle, after, "mmserve_mm_ipc_cache_hits_total") == 0  # the other salt's entry
    assert delta(middle, after, "mmserve_mm_shm_bytes_total") > 1_000_000  # written anew
    assert delta(middle, after, "mmserve_encoder_runs_total") == 1
    alone = {"type": "image_url", "image_url": None, "uuid": "e"}
    assert ask(alone, cache_salt="two") == first
    assert delta(after, server.metrics(), "mmserve_mm_processor_seconds_count") == 0


def test_a_stale_reference_is_resent_with_its_payload(shm_server: Server) -> None:
    server = shm_server  # the module's: the zeroed ring makes earlier tests' items stale too
    url = f"{server.base_url}/v1/chat/completions"
    request = body(0, [A])
    first = httpx.post(url, json=request, timeout=120).json()["choices"][0]["message"]["content"]
    before = server.metrics()
    assert server.process.proc is not None
    (ring,) = ring_files(server.process.proc.pid)
    ring.write_bytes(b"\0" * ring.stat().st_size)  # every chunk header now names item 0
    resp = httpx.post(url, json=request, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == first
    after = server.metrics()
    assert delta(before, after, "mmserve_mm_shm_stale_refs_total") == 1
    assert delta(before, after, "mmserve_mm_ipc_payload_bytes_total") > 1_000_000  # the payload went
    # the stale entry was forgotten: the next request writes the item into the ring again
    again = httpx.post(url, json=request, timeout=120).json()["choices"][0]["message"]["content"]
    assert again == first
    assert delta(after, server.metrics(), "mmserve_mm_shm_stale_refs_total") == 0


def test_nothing_left_in_dev_shm_after_sigkill_and_a_new_start(tiny_model_dir: Path, log_dir: Path) -> None:
    sems_before = named_semaphores()
    server = start_serve(tiny_model_dir, log_dir, *COMMON, *SMALL, *SHM, "--api-server-count", "2")
    try:
        wait_api_processes(server, 2)
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body(0, [B]), timeout=120)
        assert server.process.proc is not None
        crashed = [server.process.proc.pid, *descendants(server.process.proc.pid)]
        left = owned_shm_entries(crashed)
        assert len(ring_files(server.process.proc.pid)) == 2  # one ring per API process
    finally:
        server.process.kill()  # SIGKILL to the whole group: nobody cleans up
    assert left and left <= owned_shm_entries(crashed)  # the crash left its rings behind
    with serving(tiny_model_dir, log_dir, *COMMON, *SMALL, *SHM) as restarted:
        assert not owned_shm_entries(crashed)  # the new start removed them
        assert restarted.process.proc is not None
        pids = [restarted.process.proc.pid, *descendants(restarted.process.proc.pid)]
    assert not owned_shm_entries(pids)
    assert named_semaphores() <= sems_before


def jpeg_part(image: Any) -> dict[str, Any]:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_slow_image_does_not_hold_back_cache_hits(server: Server) -> None:
    """Six large photos keep the pool's only process busy for a second or more; requests whose image
    is cached are answered meanwhile (a hit never waits for the pool, nor for the event loop)."""
    hit = body(1, [C])
    photos = [jpeg_part(make_image(900 + i, (3500, 3500))) for i in range(6)]
    slow = greedy_body([{"role": "user", "content": [*photos, {"type": "text", "text": "Hi"}]}], 4)

    assert server.process.proc is not None
    pool = role_pid(server.process.proc.pid, "preprocess")

    async def run() -> tuple[list[bool], int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            assert (await client.post("/v1/chat/completions", json=hit)).status_code == 200  # now cached
            idle = cpu_ticks(pool)
            slow_task = asyncio.ensure_future(client.post("/v1/chat/completions", json=slow))
            deadline = time.monotonic() + 60  # until the pool works on the photos: all of it is still ahead
            while cpu_ticks(pool) == idle and not slow_task.done():
                assert time.monotonic() < deadline, "the pool never took the photos"
                await asyncio.sleep(0.01)

            async def hit_done_before_slow() -> bool:
                resp = await client.post("/v1/chat/completions", json=hit)
                assert resp.status_code == 200, resp.text
                return not slow_task.done()

            done_before_slow = await asyncio.gather(*(hit_done_before_slow() for _ in range(3)))
            slow_resp = await slow_task
            assert slow_resp.status_code == 200, slow_resp.text
            return list(done_before_slow), slow_resp.status_code

    done_before_slow, slow_status = asyncio.run(run())
    assert slow_status == 200
    assert all(done_before_slow), done_before_slow


def test_concurrent_misses_of_one_image_share_one_processor_run(server: Server) -> None:
    image = make_image(777, (640, 480))

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            resps = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(7, [image])) for _ in range(4))
            )
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
        return [r.json()["choices"][0]["message"]["content"] for r in resps]

    before = server.metrics()
    answers = asyncio.run(run())
    after = server.metrics()
    assert len(set(answers)) == 1
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 1
    assert delta(before, after, "mmserve_mm_items_total") == 4
