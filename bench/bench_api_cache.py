"""API-side cost of one image, by cache outcome: time spent in the API process (data-URL decode, hash,
chat template, image decode + HF processor unless a cache has the item, tokenization, mirror decision,
message hand-off) and bytes sent API→engine: multimodal bytes (tensors + keys, the
``mmserve_mm_ipc_payload_bytes`` metric) and the whole ``AddRequest`` (which also carries the prompt's
token ids). The last line puts a repeated image's API time (IPC hit) beside a new image's (full miss).

    python bench/bench_api_cache.py --model models/tiny-llava [--size 1024] [--repeats 50]

The API pieces are the real ones (HF processor, processor cache, IPC mirror, EngineClient on a real
ZeroMQ DEALER socket); the engine end is a ROUTER socket that answers ``Hello`` as a ready engine and
counts the bytes of each request it receives.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx
import zmq
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

from app.inputs.engine_client import EngineClient
from app.inputs.input_processor import InputProcessor
from app.inputs.preprocess.pool import PreprocessPool
from app.inputs.processor_cache import ProcessorCache
from app.media.fetch import MediaFetcher
from app.media.url_policy import MediaPolicy
from app.metrics import ApiMetrics
from app.settings import Settings
from wire.protocol import AddRequest, EngineReady, Hello, SamplingParams, decode_engine_inbound, encode
from workers.families import load_processing

READY = EngineReady(epoch="bench")


class ByteSink:
    """The engine end of the pipe: answers ``Hello`` as a ready engine does (until then the API sends
    no request) and counts the bytes of every ``AddRequest`` it receives, frames included."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(addr)
        self.received: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                parts = self.sock.recv_multipart(copy=False)
                msg = decode_engine_inbound(parts[1].buffer)
                if isinstance(msg, Hello):
                    self.sock.send_multipart([parts[0].bytes, encode(READY)])
                elif isinstance(msg, AddRequest):
                    self.received.append(sum(len(p.buffer) for p in parts[1:]))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


async def one_request(inputs: InputProcessor, url: str, req_id: str) -> float:
    """Seconds the API spends on a one-image request until its message is on the socket."""
    message = SimpleNamespace(
        role="user",
        content=[
            SimpleNamespace(type="image_url", image_url=SimpleNamespace(url=url)),
            SimpleNamespace(type="text", text="What is in this image?"),
        ],
    )
    start = time.perf_counter()
    prepared = await inputs.prepare([message], {})
    queue = None
    while queue is None:
        await inputs.resolve(prepared)
        queue = inputs.submit(prepared, req_id, SamplingParams(max_tokens=1))
    elapsed = time.perf_counter() - start
    inputs.engine.release(req_id, abort=False)
    return elapsed


async def run(args: argparse.Namespace) -> None:
    folder = tempfile.mkdtemp(prefix="mmserve-bench-")
    addr = f"ipc://{folder}/engine.sock"
    sink = ByteSink(addr)
    settings = Settings(model=args.model, engine_addr=addr)
    metrics = ApiMetrics()
    engine = EngineClient(addr, settings.ipc_cache_bytes, metrics)
    await engine.start()
    if not await engine.wait_ready(10.0):
        raise RuntimeError("the sink did not answer Hello")
    processor_cache = ProcessorCache(settings.processor_cache_bytes)
    async with httpx.AsyncClient() as http:
        media = MediaFetcher(MediaPolicy.from_settings(settings), http)
        family = load_processing(args.model)
        pool = PreprocessPool(args.model, 0, family=family)  # in-process: this measures API time
        inputs = InputProcessor(settings, family, processor_cache, engine, metrics, media, pool)
        url = jpeg_data_url(args.size, seed=0)
        print(
            f"image: {args.size}x{args.size} JPEG, {len(url) * 3 // 4 / 1024:.0f} KiB encoded; "
            f"{args.repeats} runs per case (median, min)"
        )
        await one_request(inputs, jpeg_data_url(args.size, seed=1), "warmup")  # first-call costs

        def full_miss() -> None:
            processor_cache.clear()
            engine.reset_caches()

        cases = {"full miss": full_miss, "processor-cache hit": engine.reset_caches, "IPC hit": lambda: None}
        await one_request(inputs, url, "prime")
        medians: dict[str, float] = {}
        for name, prepare_case in cases.items():
            times, sizes, mm_sizes = [], [], []
            for i in range(args.repeats):
                prepare_case()
                await asyncio.sleep(0.02)
                before = len(sink.received)
                mm_before = metrics.ipc_payload_bytes._value.get()
                times.append(await one_request(inputs, url, f"{name}-{i}"))
                while len(sink.received) == before:
                    await asyncio.sleep(0.001)
                sizes.append(sink.received[-1])
                mm_sizes.append(metrics.ipc_payload_bytes._value.get() - mm_before)
            medians[name] = statistics.median(times)
            print(
                f"{name:>20}: {statistics.median(times) * 1e3:7.2f} ms  (min {min(times) * 1e3:6.2f} ms)  "
                f"multimodal {statistics.median(mm_sizes):>10,.0f} B  "
                f"whole message {statistics.median(sizes):>10,.0f} B"
            )
        hit, miss = medians["IPC hit"], medians["full miss"]
        print(
            f"{'hit vs miss':>20}: IPC hit {hit * 1e3:.2f} ms vs full miss {miss * 1e3:.2f} ms of API time "
            f"(median; the hit costs {hit / miss:.1%} of a miss)"
        )
    await engine.close()
    sink.close()
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=50)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
