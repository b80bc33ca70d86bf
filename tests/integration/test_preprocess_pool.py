"""The preprocessing pool (app/inputs/preprocess/pool.py): spawned processes give exactly the in-process
items,
through shared memory that never leaks, with the same request errors, and survive a killed process; no
/dev/shm entry (no multiprocessing semaphore) outlives a pool, even when its process group is SIGKILLed."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from PIL import Image

from app.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    InvalidRequestError,
    MediaError,
    MMServeError,
    ModelNotFoundError,
)
from app.inputs.preprocess.pool import PreprocessPool, output_name, read_output, write_output
from tests.e2e.server import alive, cpu_ticks, descendants, process_title
from workers.families import load_processing
from workers.families.processing import FamilyProcessor, ItemLayout, ProcessedItem

T = TypeVar("T")
PARAM = "messages[0].content[1].image_url.url"
TIMEOUT_S = 60.0


def png(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


IMAGES = [png(0, (320, 240)), png(1, (200, 410)), png(2, (90, 120))]
OPTIONS = {
    "llava": {"do_normalize": False, "size": {"shortest_edge": 400}},
    "qwen2_vl": {"max_pixels": 56 * 56 * 4},
}


def shm_files() -> list[str]:
    return glob.glob(f"/dev/shm/mmserve.{os.getpid()}.out-*")


def shm_entries(prefix: str) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def assert_same(got: ProcessedItem, want: ProcessedItem) -> None:
    assert list(got.tensors) == list(want.tensors)
    for key, tensor in want.tensors.items():
        assert got.tensors[key].dtype == tensor.dtype, key
        assert torch.equal(got.tensors[key], tensor), key
    assert (got.num_tokens, got.grid_thw) == (want.num_tokens, want.grid_thw)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per module, in this (the main) thread, as the API runs its pool."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT_S) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def all_of(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    return list(await asyncio.gather(*coros))


@pytest.fixture(scope="module")
def qwen_model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, qwen_model_dir: Path) -> dict[str, Path]:
    return {"llava": tiny_model_dir, "qwen2_vl": qwen_model_dir}


@pytest.fixture(scope="module")
def families(model_dirs: dict[str, Path]) -> dict[str, FamilyProcessor]:
    return {name: load_processing(model_dir) for name, model_dir in model_dirs.items()}


@pytest.fixture(scope="module")
def pools(
    loop: asyncio.AbstractEventLoop, model_dirs: dict[str, Path]
) -> Iterator[dict[str, PreprocessPool]]:
    """Started pools shared by the module: LLaVA with 2 processes, Qwen2-VL with 1."""
    pools = {
        "llava": PreprocessPool(str(model_dirs["llava"]), 2),
        "qwen2_vl": PreprocessPool(str(model_dirs["qwen2_vl"]), 1),
    }
    try:
        run(loop, all_of(pool.start() for pool in pools.values()), timeout=180)
        yield pools
    finally:
        run(loop, all_of(pool.close() for pool in pools.values()))


def in_process(
    loop: asyncio.AbstractEventLoop, family: FamilyProcessor, data: bytes, options: dict[str, Any]
) -> Any:
    pool = PreprocessPool(str(family.model_dir), 0, family=family)
    try:
        return run(loop, pool.process(data, options, PARAM))
    except MMServeError as exc:
        return exc


# -- without processes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        MediaError("bad bytes", param=PARAM, code="unsupported_image_format"),
        InvalidRequestError("no", param="mm_processor_kwargs"),
        ModelNotFoundError("which model?"),
        ContextLengthError("too long", param=None),
    ],
)
def test_request_errors_pickle(error: MMServeError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert (back.message, back.param, back.code, back.args) == (
        error.message,
        error.param,
        error.code,
        error.args,
    )


def test_shm_round_trip_keeps_dtypes_and_unlinks() -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
    }
    output = write_output(ProcessedItem(tensors, ItemLayout(9, (1, 2, 3))), output_name(os.getpid()))
    assert all(slot.offset % 64 == 0 for slot in output.tensors)
    assert Path("/dev/shm", output.name).exists()
    back = read_output(output)
    assert_same(back, ProcessedItem(tensors, ItemLayout(9, (1, 2, 3))))
    assert not Path("/dev/shm", output.name).exists()


def test_threads_need_the_family() -> None:
    with pytest.raises(ValueError):
        PreprocessPool("unused", 0)


# -- with the pool processes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("with_options", [False, True], ids=["defaults", "options"])
def test_pool_gives_the_in_process_item(loop, pools, families, name: str, with_options: bool) -> None:
    family = families[name]
    options = family.hash_options(OPTIONS[name] if with_options else None)
    assert bool(options) == with_options
    for data in IMAGES[:2]:
        want = in_process(loop, family, data, options)
        assert isinstance(want, ProcessedItem)
        assert_same(run(loop, pools[name].process(data, options, PARAM)), want)
    assert pools[name].num_processes == (2 if name == "llava" else 1)
    assert shm_files() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "kwargs", "error"),
    [
        (b"not an image at all", None, MediaError),
        (IMAGES[0], {"crop_size": {"height": 224, "width": 224}}, InvalidRequestError),  # the encoder's size
    ],
    ids=["not-an-image", "refused-by-processor"],
)
def test_request_errors_cross_as_themselves(loop, pools, families, data, kwargs, error) -> None:
    options = families["llava"].hash_options(kwargs)
    want = in_process(loop, families["llava"], data, options)
    assert type(want) is error
    with pytest.raises(error) as got:
        run(loop, pools["llava"].process(data, options, PARAM))
    assert type(got.value) is error
    assert (got.value.message, got.value.param, got.value.code) == (want.message, want.param, want.code)
    assert shm_files() == []


@pytest.mark.slow
def test_concurrent_calls_all_succeed(loop, pools, families) -> None:
    datas = IMAGES * 3
    got = run(loop, all_of(pools["llava"].process(data, {}, PARAM) for data in datas))
    for data, item in zip(datas, got, strict=True):
        assert_same(item, in_process(loop, families["llava"], data, {}))
    assert shm_files() == []


@pytest.mark.slow
def test_a_slow_image_holds_one_process_only(loop, pools) -> None:
    """36 MB of encoded bytes keep one process busy (the send runs off the event loop); the other
    process takes the calls that come after it."""
    out = io.BytesIO()
    pixels = np.random.default_rng(6).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    big, finished = out.getvalue(), []

    async def call(name: str, data: bytes) -> None:
        await pools["llava"].process(data, {}, PARAM)
        finished.append(name)

    run(loop, all_of([call("big", big), *(call(f"small-{i}", IMAGES[2]) for i in range(3))]))
    assert finished[-1] == "big", finished
    assert shm_files() == []


@pytest.mark.slow
def test_processes_are_titled_and_ignore_sigint(pools) -> None:
    for pid in pools["llava"].pids:
        assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"mmserve: preprocess")
        sig_ign = next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn")
        )
        assert int(sig_ign.split()[1], 16) & (1 << (signal.SIGINT - 1))


@pytest.mark.slow
def test_cancelled_call_leaves_no_file(loop, pools) -> None:
    big = png(3, (1600, 1200))

    async def cancel_soon(delay_s: float) -> None:
        task = asyncio.ensure_future(pools["llava"].process(big, {}, PARAM))
        await asyncio.sleep(delay_s)
        task.cancel()  # before the pool picked it up, while it runs, or (fine too) after it finished
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for delay_s in (0.0, 0.02, 0.05, 0.1):
        run(loop, cancel_soon(delay_s))
    deadline = time.monotonic() + 10
    while shm_files() and time.monotonic() < deadline:
        run(loop, asyncio.sleep(0.05))
    assert shm_files() == []


@pytest.mark.slow
def test_killed_process_is_replaced(loop, pools, families) -> None:
    pool, family = pools["qwen2_vl"], families["qwen2_vl"]
    want = in_process(loop, family, IMAGES[0], {})
    (pid,) = pool.pids
    os.kill(pid, signal.SIGKILL)

    async def replaced() -> None:  # an idle process's death is seen at once: EOF on its pipe
        while pid in pool.pids:
            await asyncio.sleep(0.01)

    run(loop, replaced(), timeout=10)
    assert len(pool.pids) == 1
    assert_same(run(loop, pool.process(IMAGES[0], {}, PARAM)), want)  # once the new one has loaded
    assert_same(run(loop, pool.process(IMAGES[0], {}, PARAM)), want)


@pytest.mark.slow
def test_close_stops_every_process(loop, pools) -> None:
    pids = [pid for pool in pools.values() for pid in pool.pids]
    assert len(pids) == 3
    llava = pools["llava"]

    out = io.BytesIO()
    pixels = np.random.default_rng(7).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)  # 36 MB: more than a pipe holds

    async def close_under_load() -> list[Any]:
        big = asyncio.ensure_future(llava.process(out.getvalue(), {}, PARAM))
        calls = [asyncio.ensure_future(llava.process(png(4, (1600, 1200)), {}, PARAM)) for _ in range(5)]
        await asyncio.sleep(0)  # the big call and the first small one are each given a process
        for pid in llava.pids:  # neither can answer now, however fast this machine is: both stay busy
            os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(0.3)  # the big call's send blocks on the stopped process's full pipe
        await llava.close()
        return await asyncio.gather(big, *calls, return_exceptions=True)

    # running calls are abandoned (nobody waits for them once the server stops: their processes are
    # killed, even mid-send), queued ones are cancelled: the server is shutting down (503)
    big, *outcomes = run(loop, close_under_load())
    assert isinstance(big, InternalError), big
    assert [type(outcome) for outcome in outcomes] == [InternalError] + [EngineUnavailableError] * 4
    for pool in pools.values():
        run(loop, pool.close())
        run(loop, pool.close())  # idempotent
        with pytest.raises(EngineUnavailableError):
            run(loop, pool.process(IMAGES[0], {}, PARAM))
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert all(pool.pids == [] for pool in pools.values())
    assert shm_files() == []


@pytest.mark.slow
def test_start_fails_when_the_family_does_not_load(loop, tmp_path: Path) -> None:
    """The API serves while its pool loads: a call made meanwhile, and every call after, gets the
    failure as a 500 naming it."""
    pool = PreprocessPool(str(tmp_path / "no-such-model"), 1)

    async def call_during_start() -> BaseException | None:
        start = asyncio.ensure_future(pool.start())
        await asyncio.sleep(0)  # the processes are spawned, not yet loaded
        waiting = asyncio.ensure_future(pool.process(IMAGES[0], {}, PARAM))
        results = await asyncio.gather(start, waiting, return_exceptions=True)
        with pytest.raises(RuntimeError, match="could not load"):
            raise results[0]  # type: ignore[misc]
        return results[1]  # type: ignore[return-value]

    during = run(loop, call_during_start())
    assert isinstance(during, InternalError) and "could not load" in during.message
    assert pool.pids == []
    with pytest.raises(InternalError, match="could not load"):
        run(loop, pool.process(IMAGES[0], {}, PARAM))


@pytest.mark.slow
def test_killed_call_and_close_leave_no_shm_entry(loop, tiny_model_dir: Path) -> None:
    """No multiprocessing semaphore anywhere: processing, a process SIGKILLed mid-call and its
    replacement, then close() add no /dev/shm entry (entries from before are not ours)."""
    sems_before = shm_entries("sem.")
    pool = PreprocessPool(str(tiny_model_dir), 1)
    big = png(5, (1600, 1200))

    async def kill_mid_call() -> None:
        (pid,) = pool.pids
        cpu_before = cpu_ticks(pid)
        call = asyncio.ensure_future(pool.process(big, {}, PARAM))
        while cpu_ticks(pid) == cpu_before and not call.done():  # it has the call and works on it
            await asyncio.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(InternalError, match="died"):
            await call

    try:
        run(loop, pool.start(), timeout=180)
        for data in IMAGES:
            run(loop, pool.process(data, {}, PARAM))
        assert not _maps_a_semaphore(pool.pids[0])
        run(loop, kill_mid_call())
        run(loop, pool.process(IMAGES[0], {}, PARAM))  # on the replacement
        (pid,) = pool.pids
        assert not _maps_a_semaphore(pid)
    finally:
        run(loop, pool.close())
    assert pool.pids == []
    assert not alive(pid)
    assert shm_entries("sem.") - sems_before == set()
    assert shm_files() == []


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["api", "group"])
def test_killed_api_leaves_no_process_nor_shm_entry(
    tiny_model_dir: Path, tmp_path: Path, killed: str
) -> None:
    """An API-like process with a started pool, SIGKILLed alone (the fork server sees it go and exits;
    the pool processes it forked follow by PR_SET_PDEATHSIG) or with its whole process group (resource
    tracker included): every process goes and no /dev/shm entry stays behind (``sem.*`` names carry no
    owner, so none may be created at all)."""
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from app.inputs.preprocess.pool import PreprocessPool

        async def main():
            pool = PreprocessPool({str(tiny_model_dir)!r}, 1)
            await pool.start()
            await pool.process({IMAGES[2]!r}, {{}}, "image")
            print(*pool.pids, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    repo = Path(__file__).resolve().parents[2]
    sems_before = shm_entries("sem.")
    # stderr to a file: a killed process's resource tracker would report semaphores left behind
    with (tmp_path / "api.stderr").open("w+") as stderr:
        api = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=repo,
            start_new_session=True,  # its own process group, as a server's
        )
        pids: list[int] = []
        try:
            assert api.stdout is not None
            line = api.stdout.readline()
            # the resource tracker, the fork server and the pool process it forked
            pids = [api.pid, *descendants(api.pid)]
            fork_servers = [pid for pid in pids if process_title(pid) == "mmserve: fork server"]
            assert not any(_maps_a_semaphore(pid) for pid in pids)
        finally:
            if killed == "group":
                os.killpg(api.pid, signal.SIGKILL)
            else:
                # stopped, the pool process cannot see its pipe close: only PR_SET_PDEATHSIG can end it
                os.kill(int(line), signal.SIGSTOP)
                api.kill()
            api.wait()
        stderr.seek(0)
        assert line.strip().isdigit(), stderr.read()
        (pool_pid,) = map(int, line.split())
        assert pool_pid in pids and len(pids) == 4
        if killed == "api":
            try:
                (fork_server,) = fork_servers
                deadline = time.monotonic() + 10
                while alive(fork_server) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not alive(fork_server), "the fork server exits with the API, whatever its forks do"
                while alive(pool_pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not alive(pool_pid), "its PR_SET_PDEATHSIG (SIGKILL) ended it, stopped as it was"
            finally:  # (were it alive, it would end at its pipe's EOF)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pool_pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
        stderr.seek(0)
        assert "leaked" not in stderr.read()
    assert shm_entries("sem.") - sems_before == set()
    assert shm_entries(f"mmserve.{api.pid}.") == set()


def _maps_a_semaphore(pid: int) -> bool:
    return "/dev/shm/sem." in Path(f"/proc/{pid}/maps").read_text()


def test_a_large_image_through_a_pool_on_uvloop(tiny_model_dir: Path, families) -> None:
    """uvicorn runs on uvloop where it is installed (``uvicorn[standard]``, the CUDA images), and uvloop
    makes every fd it watches non-blocking: the pool's pipe then took a frame bigger than its buffer
    (a 1.5 MB PNG) only part-way, and the process was killed as broken."""
    import uvloop

    data = png(3, (768, 640))
    assert len(data) > 1_000_000
    loop = uvloop.new_event_loop()
    pool = PreprocessPool(str(tiny_model_dir), 1)
    try:
        run(loop, pool.start(), timeout=180)
        assert_same(run(loop, pool.process(data, {}, PARAM)), in_process(loop, families["llava"], data, {}))
        assert pool.num_processes == 1
    finally:
        run(loop, pool.close())
        loop.close()
