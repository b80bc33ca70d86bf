"""Fixtures of the end-to-end tier: real processes on the tiny model, and transformers' own
``generate`` on the same checkpoint as the correctness oracle."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import GenerationConfig

from tests.e2e.server import Server, serving, start_serve, stop_all
from tests.stock_processor import stock_processor
from workers.families import family_for


def make_image(seed: int, size: tuple[int, int] = (320, 240)) -> PIL.Image.Image:
    """A deterministic image: smooth colour blobs plus noise, different for every seed."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(low).resize(size, PIL.Image.Resampling.BILINEAR)
    noise = rng.integers(-20, 20, size=(size[1], size[0], 3))
    return PIL.Image.fromarray(np.clip(np.asarray(image, dtype=np.int32) + noise, 0, 255).astype(np.uint8))


def png_bytes(image: PIL.Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def send_png(handler: Any, body: bytes) -> None:
    """A 200 with ``body`` as ``image/png`` from an ``http.server`` request handler."""
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def data_url(image: PIL.Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def user_message(text: str, *images: PIL.Image.Image) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


def greedy_body(messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A deterministic chat request: greedy, exactly ``max_tokens`` tokens."""
    return {
        "model": "tiny-llava",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


@dataclass
class Oracle:
    """Greedy decoding by transformers' ``generate`` on the checkpoint the server serves."""

    processor: Any
    model: Any  # the family's *ForConditionalGeneration

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Oracle:
        """transformers' own processor of the checkpoint (tests/stock_processor.py: the saved class, not
        the product's processing) and its model class, in ``dtype`` on ``device`` (the CUDA tier's
        oracle is bf16 on the GPU the server uses: tests/gpu)."""
        model = family_for(model_dir).model.hf_class.from_pretrained(model_dir, dtype=dtype)
        return cls(stock_processor(model_dir), model.to(device).eval())

    def inputs(self, text: str, images: list[PIL.Image.Image]) -> Any:
        """The processor's full model inputs for one user turn (Qwen: with ``mm_token_type_ids``,
        without which transformers' Qwen2.5-VL silently falls back to 1-D positions)."""
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        return self.processor(text=[prompt], images=images or None, return_tensors="pt")

    def greedy(
        self, text: str, images: list[PIL.Image.Image], max_new_tokens: int
    ) -> tuple[list[int], torch.Tensor]:
        """Token ids and per-step log-probabilities, EOS ignored (like the server's ``ignore_eos``)."""
        return self.greedy_inputs(self.inputs(text, images), max_new_tokens)

    def greedy_inputs(self, inputs: Any, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """``greedy`` on the model inputs the HF processor made (e.g. with videos, in the reference
        environment: tests/reference/client.py)."""
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=self.processor.tokenizer.pad_token_id,
        )
        # a BatchFeature, or a dict of tensors from tests/reference
        inputs = {k: v.to(self.model.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, generation_config=config, output_scores=True, return_dict_in_generate=True
            )
        ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).cpu()
        return ids, logprobs


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Path) -> Oracle:
    return Oracle.load(tiny_model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``mmserve serve`` with every cache on, shared by the e2e tests that only send requests. It may
    fetch from loopback (``image_http_server``); tests/e2e/test_media_policy.py checks the default policy."""
    with serving(
        tiny_model_dir,
        tmp_path_factory.mktemp("serve"),
        "--max-model-len",
        "4096",
        "--fetch-timeout-s",
        "2",
        "--allow-private-media-urls",
    ) as srv:
        yield srv


# Every multimodal cache off: what each request must answer when nothing is reused
# (tests/e2e/test_caches.py, tests/e2e/test_shm_serving.py).
UNCACHED = ("--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--encoder-cache-tokens", "0")
# Prefill steps of 640 tokens that never split an image (tests/e2e/test_kv_cache.py).
WHOLE_IMAGES = ("--disable-chunked-mm-input", "--max-num-batched-tokens", "640")
# Media by URL only from a name that never resolves: nothing is fetched (tests/e2e/test_openapi_fuzz.py).
NO_FETCH = ("--allowed-media-domains", "fuzz.invalid", "--fetch-timeout-s", "2")


@pytest.fixture(scope="session")
def uncached_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny LLaVA with every multimodal cache off, in steps that take whole images only, fetching
    nothing; shared by the modules that compare against it (they measure its counters as differences)
    and by the fuzzer (whose POST /reset_mm_cache finds no cache to disturb)."""
    folder = tmp_path_factory.mktemp("uncached")
    flags = ("--max-model-len", "2048", *UNCACHED, *WHOLE_IMAGES, *NO_FETCH)
    with serving(tiny_model_dir, folder, *flags) as srv:
        yield srv


@pytest.fixture(scope="session")
def narrow_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny LLaVA with small limits: one running request and one waiting place
    (tests/e2e/test_backpressure.py), and an encoder budget of 100 tokens, below its 576-token image
    (tests/e2e/test_budgets.py)."""
    flags = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--encoder-compute-budget-tokens", "100")
    with serving(tiny_model_dir, tmp_path_factory.mktemp("narrow"), *flags) as srv:
        yield srv


API_KEY = "sk-mmserve-e2e"  # the key of guarded_server
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def guarded_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny LLaVA behind ``--api-key API_KEY`` with a 1 MB body cap
    (tests/e2e/test_api_key_and_body_cap.py); the LM behind the proxy of tests/e2e/test_proxy_serving.py."""
    flags = ("--api-key", API_KEY, "--max-request-body-mb", "1")
    with serving(tiny_model_dir, tmp_path_factory.mktemp("guarded"), *flags) as srv:
        yield srv


@pytest.fixture(scope="session")
def family_server(
    request: pytest.FixtureRequest,
    tiny_model: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Server]]:
    """``family_server(family, *flags)``: a server on that family's tiny checkpoint with those flags (the
    defaults when none; LLaVA's default one is ``server``), started on first use and shared by the rest
    of the session. It may fetch from loopback. Tests that only send requests share it; they measure its
    counters as differences."""
    started: dict[tuple[str, ...], Server] = {}

    def get(family: str, *flags: str) -> Server:
        if family == "llava" and not flags:
            return request.getfixturevalue("server")
        key = (family, *flags)
        if key not in started:
            folder = tmp_path_factory.mktemp(f"serve-{family}")
            started[key] = start_serve(tiny_model(family), folder, "--allow-private-media-urls", *flags)
        return started[key]

    try:
        yield get
    finally:
        stop_all(list(started.values()))


@pytest.fixture(scope="session")
def family_oracle(tiny_model: Callable[[str], Path]) -> Callable[[str], Oracle]:
    """``family_oracle(family)``: transformers' model on that family's tiny checkpoint, loaded once."""
    loaded: dict[str, Oracle] = {}

    def get(family: str) -> Oracle:
        if family not in loaded:
            loaded[family] = Oracle.load(tiny_model(family))
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def image_http_server() -> Iterator[str]:
    """A loopback HTTP server: /imgN.png is ``make_image(N)`` as PNG; /slow.png answers after 5 s."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/slow.png":
                time.sleep(5)
            name = self.path.removeprefix("/img").removesuffix(".png")
            if not name.isdigit():
                self.send_error(404)
                return
            send_png(self, png_bytes(make_image(int(name))))

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
