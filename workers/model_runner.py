"""Executes the engine's scheduled steps: vision encoder, embedding splice, LM forward, sampling.

Per step (``execute``), in this order::

    drop freed encoder outputs, finished requests (all state) and     <- scheduler's decisions
      preempted requests' block tables (tokens and sampling state stay)
    apply resumed requests, new requests (sent once, in full) and new blocks of running requests
    encode all of the step's encoder inputs as ONE batch (the family's encoder) -> encoder store
    embed every scheduled token; placeholder positions take rows of their item's encoder output
      (level 0; deeper levels, where the family has them, become the step's deepstack inputs)
    ONE varlen forward of the family's own text model over all scheduled tokens of all requests, at
      the family's positions (1-D or M-RoPE), K/V in the paged pool
    sample for requests whose step computed their last known token; append the token to the request

The worker owns no policy: what runs, what is encoded, which blocks hold a request's K/V and what is
dropped all come from the ``SchedulerOutput``. It only tracks each request's tokens, how many of them
have K/V in its blocks, its block table and its positions. Everything model-specific comes from the
checkpoint's family (``workers.families``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from wire.ec_store import ECConfig
from wire.ec_store.reconnecting import ReconnectingStore
from wire.protocol import (
    ECConnectorMeta,
    EncoderInput,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from wire.shm_ring import ShmRingReader, StaleShmRef
from workers.attention import attention_backend
from workers.config import ModelParts
from workers.decode_graphs import DecodeGraphs, prepare_weights
from workers.ec_connector import ECConnectorWorker
from workers.encoder_store import EncoderStore
from workers.families import family_for
from workers.frames import Buffer, tensor_from_frame, tensors_from_shm
from workers.kv_pool import KVPool, kv_bytes_per_token, plan_num_kv_blocks
from workers.paged_lm import PagedLanguageModel
from workers.prompt_logprobs import PromptLogprobRows
from workers.runner_requests import (
    Pool,
    RequestState,
    StepError,
    append_forced_tokens,
    check_additions,
    grammar_rows,
    step_spans,
)
from workers.sampler import Sampled, SamplingRow, make_generator, sample_on_device
from workers.step_embeddings import step_embeddings

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step between ``ModelRunner.launch`` and ``finish``: its forward's logits (until ``sample``),
    the requests that sample and their sampling rows, then its sampled tokens on the device."""

    step_id: int
    frames: Sequence[Buffer]  # kept: the grammar bitmask rows are views of a frame
    num_encoded_items: int
    encoder_seconds: float
    forward_seconds: float = 0.0
    seconds: float = 0.0  # the worker's time on it so far
    req_ids: list[str] = field(default_factory=list)  # the requests that sample, in row order
    rows: list[SamplingRow] = field(default_factory=list)
    logits: torch.Tensor | None = None
    sampled: Sampled | None = None
    prompt_logprobs: PromptLogprobRows = field(default_factory=PromptLogprobRows)


class EncoderOutputUnavailable(RuntimeError):
    """Encoder outputs the step needs could not be loaded from the store, and this worker has no vision
    tower to encode them (the engine answers the step's requests with 503)."""

    def __init__(self, mm_hashes: list[str]) -> None:
        super().__init__(f"encoder outputs not in the store and no vision tower here: {mm_hashes}")
        self.mm_hashes = mm_hashes


def resolve_device(name: str = "auto") -> tuple[torch.device, torch.dtype]:
    """ "auto" picks CUDA when available. CUDA runs in bfloat16, CPU in float32."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        *,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        parts: ModelParts = ModelParts.ALL,
        ec: ECConfig | None = None,
        attention: str = "batched",
        decode_graphs: bool | None = None,
    ):
        """Load the model's ``parts``, then allocate the KV pool (sized from what the weights left free;
        none without a language model). ``ec``: the encoder-cache connector, if any; ``attention``: the
        attention backend's name (``workers.attention``); ``decode_graphs``: decode-only steps in fixed
        shapes, replayed as CUDA graphs (``workers.decode_graphs``; default: on CUDA only)."""
        self.device, self.dtype = resolve_device(device)
        self.family = family_for(model_dir)
        self.model = self.family.model(model_dir, self.device, self.dtype, parts)
        self.parts = parts
        self.embed_tokens = self.model.embed_tokens
        self.encoder_store = EncoderStore()
        self.shm_reader = ShmRingReader()  # the API processes' rings, opened on first use
        self.requests: dict[str, RequestState] = {}
        self.generator = torch.Generator(device=self.device)  # unseeded requests share it
        self.generator.seed()
        self.ec_connector = None
        if ec is not None:
            self.ec_connector = ECConnectorWorker(
                ReconnectingStore(ec),
                ec.role,
                self.encoder_store,
                tail=self.model.encoder_output_tail,
                device=self.device,
                dtype=self.dtype,
            )
        self.block_size = block_size
        self.attention = attention_backend(attention, self.dtype)
        self.lm_forward: PagedLanguageModel | DecodeGraphs | None = None
        if parts.has_language_model:
            graphs = self.device.type == "cuda" if decode_graphs is None else decode_graphs
            self._load_language_model(model_dir, kv_cache_tokens, gpu_memory_utilization, graphs)
        else:
            logger.info(
                "loaded the vision tower of %s (%s) on %s (%s)",
                model_dir,
                self.family.name,
                self.device,
                self.dtype,
            )

    def _load_language_model(
        self, model_dir: str, kv_cache_tokens: int | None, gpu_memory_utilization: float, graphs: bool
    ) -> None:
        block_size = self.block_size
        if graphs:
            prepare_weights(self.model.language_model, self.device)  # before the pool takes the rest
        num_layers, num_kv_heads, head_dim = PagedLanguageModel.kv_shape(self.model.language_model)
        num_blocks = plan_num_kv_blocks(
            block_size=block_size,
            bytes_per_token=kv_bytes_per_token(num_layers, num_kv_heads, head_dim, self.dtype),
            device=self.device,
            kv_cache_tokens=kv_cache_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.kv_pool = KVPool(
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            self.dtype,
            self.device,
            spare_blocks=1 if graphs else 0,
        )
        lm = PagedLanguageModel(self.model.language_model, self.model.lm_head, self.kv_pool, self.attention)
        self.lm_forward = DecodeGraphs(lm, self.embed_tokens.embedding_dim) if graphs else lm
        logger.info(
            "loaded %s (%s) on %s (%s); KV pool %d blocks x %d tokens (%.1f MiB); decode steps %s",
            model_dir,
            self.family.name,
            self.device,
            self.dtype,
            num_blocks,
            block_size,
            self.kv_pool.num_bytes / 2**20,
            ("as CUDA graphs" if self.device.type == "cuda" else "in fixed shapes") if graphs else "eager",
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_pool.num_blocks if self.lm_forward is not None else 0

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding: a prompt token id at or above it could not be embedded."""
        return int(self.embed_tokens.num_embeddings) if self.lm_forward is not None else 0

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> RunnerOutput:
        """Run one step. ``frames`` is the whole multipart message (indexed by ``TensorRef.frame``;
        frame 0, the message itself, is not read)."""
        return self.finish(self.sample(self.launch(sched, frames)))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> LaunchedStep:
        """A step up to its forward, which is on the device's stream when this returns (on a GPU, still
        running): the scheduler's decisions, the encoder, the embeddings and the forward. A request
        whose last token is still being sampled by the step before (``sample`` ran, ``finish`` not
        yet) takes that token from the device (``RequestState.pending``). ``sample`` next, once the
        step before is finished."""
        received = time.perf_counter()
        self._apply_decisions(sched)

        start = time.perf_counter()
        num_encoded_items = self._load_and_encode(sched, frames)
        if num_encoded_items and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        encoded = time.perf_counter()

        step = LaunchedStep(sched.step_id, frames, num_encoded_items, encoder_seconds=encoded - start)
        if self.lm_forward is not None:
            allowed = grammar_rows(sched, frames, self.vocab_size)
            self._forward(step, sched.num_scheduled_tokens, allowed)
        elif any(sched.num_scheduled_tokens.values()):
            raise StepError("tokens scheduled on an encoder-only worker (it has no language model)")
        done = time.perf_counter()
        step.forward_seconds = done - encoded
        step.seconds = done - received
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> LaunchedStep:
        """Puts the step's sampling on the device's stream (after its forward) and the copy of its
        tokens to the host; its requests' next tokens are pending until ``finish``. Call it once the
        step before is finished: penalties and ``min_tokens`` read every earlier token."""
        started = time.perf_counter()
        if step.logits is not None:
            step.sampled = sample_on_device(step.logits, step.rows)
            step.logits = None
            for i, req_id in enumerate(step.req_ids):
                self.requests[req_id].pending = (step.sampled.token_ids, i)
        elapsed = time.perf_counter() - started
        step.forward_seconds += elapsed
        step.seconds += elapsed
        return step

    def finish(self, step: LaunchedStep) -> RunnerOutput:
        """Waits for the step's tokens on the host (not for what the device does after them), appends
        each to its request, and gives the step's reply."""
        started = time.perf_counter()
        sampled_token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        if step.sampled is not None:
            sampled_token_ids, logprobs = step.sampled.to_host()
            for req_id, token_id in zip(step.req_ids, sampled_token_ids, strict=True):
                req = self.requests.get(req_id)
                if req is not None:  # (a later step may have ended it: the engine ignores this token)
                    req.token_ids.append(token_id)
                    req.pending = None
        elapsed = time.perf_counter() - started
        return RunnerOutput(
            step_id=step.step_id,
            req_ids=step.req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            num_encoded_items=step.num_encoded_items,
            encoder_seconds=step.encoder_seconds,
            forward_seconds=step.forward_seconds + elapsed,
            step_seconds=step.seconds + elapsed,
            ec_stats=self.ec_connector.take_stats() if self.ec_connector is not None else None,
            prompt_logprobs=step.prompt_logprobs.to_host(),
        )

    def forget_pending(self) -> None:
        """A step that was sampled will not be finished (it failed): its requests' tokens are unknown."""
        for req in self.requests.values():
            req.pending = None

    def _load_and_encode(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> int:
        """The connector's loads first (``start_load_caches``); an item whose load failed is encoded
        when its tensors came along, else the step fails (``EncoderOutputUnavailable``). Then the
        encoder on the rest, and a producer saves what it encoded (``save_caches``). Returns the
        number of items encoded."""
        inputs = sched.encoder_inputs
        if self.ec_connector is None:
            return self._encode(inputs, frames)
        meta = sched.ec_meta if sched.ec_meta is not None else ECConnectorMeta()
        loads = meta.load_mm_hashes
        failed = self.ec_connector.start_load_caches(meta, self._placement_sizes(loads))
        loaded = set(loads) - set(failed)
        inputs = [item for item in inputs if item.mm_hash not in loaded]
        unavailable = sorted(set(failed) - {item.mm_hash for item in inputs})
        if unavailable:
            raise EncoderOutputUnavailable(unavailable)
        self.ec_connector.count_fallback_encodes(len(failed))
        num_encoded = self._encode(inputs, frames)
        self.ec_connector.save_caches([*(item.mm_hash for item in inputs), *meta.save_mm_hashes])
        return num_encoded

    def _placement_sizes(self, mm_hashes: list[str]) -> dict[str, int]:
        """Placeholder counts of the items to load, from the requests that placed them."""
        wanted = set(mm_hashes)
        return {
            f.mm_hash: f.num_tokens
            for req in self.requests.values()
            for f in req.mm_features
            if f.mm_hash in wanted
        }

    def _apply_decisions(self, sched: SchedulerOutput) -> None:
        """The scheduler's bookkeeping for this step, in the protocol's order. Drops never fail (unknown
        ids are ignored: the engine may end a request this worker never saw); forced tokens are checked
        before any is appended, additions before any is applied, so a contradicting step raises
        ``StepError`` before it changes what it contradicts."""
        self.encoder_store.free(sched.free_mm_hashes)
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                # Its blocks may already belong to someone else; its tokens and generator stay so that
                # the resumed request continues exactly where it stopped.
                req.block_ids, req.num_computed_tokens = None, 0

        append_forced_tokens(sched.forced_tokens, self.requests)
        pool = Pool(self.kv_pool.num_blocks if self.lm_forward is not None else None, self.block_size)
        layouts = check_additions(
            sched, self.requests, pool, self.model.prompt_positions, self.model.placeholder_token_ids
        )
        for resumed in sched.resumed_requests:
            req = self.requests[resumed.req_id]
            req.block_ids, req.num_computed_tokens = list(resumed.block_ids), resumed.num_computed_tokens
        for new in sched.new_requests:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                mm_features=list(new.mm_features),
                sampling=new.sampling,
                generator=make_generator(new.sampling.seed, self.device, self.generator),
                block_ids=list(new.block_ids),
                positions=layouts[new.req_id].positions,
                placements=layouts[new.req_id].placements,
                num_computed_tokens=new.num_computed_tokens,
            )
        for req_id, block_ids in sched.new_block_ids.items():
            table = self.requests[req_id].block_ids
            assert table is not None  # checked
            table.extend(block_ids)
        for source, destination, num_tokens in sched.kv_copies:
            self.kv_pool.copy_slots(source, destination, num_tokens)

    def _forward(
        self, step: LaunchedStep, num_scheduled_tokens: dict[str, int], allowed: dict[str, torch.Tensor]
    ) -> None:
        """One forward over every scheduled token; the step samples for each request whose step
        computes its last known token (the end of its prompt, of its recomputed outputs after a resume,
        or the token it sampled last, pending or not); ``allowed``: the constrained ones' grammar
        bitmask rows."""
        if not num_scheduled_tokens:
            return
        spans = step_spans(num_scheduled_tokens, self.requests, self.block_size)
        token_ids: list[int] = []
        pending: list[tuple[int, tuple[torch.Tensor, int]]] = []  # (index in token_ids, where it is)
        positions: list[torch.Tensor | list[int]] = []  # each span's; a decode's as a list
        logits_rows: list[int] = []  # each sampling request's last scheduled token
        for span in spans:
            req = self.requests[span.req_id]
            num_computed = span.num_past_tokens + span.num_new_tokens
            num_top = req.sampling.num_prompt_logprobs
            if num_top is not None:  # its positions that predict a prompt token: all but the prompt's last
                first = span.num_past_tokens + 1
                targets = req.token_ids[first : min(num_computed + 1, req.num_prompt_tokens)]
                step.prompt_logprobs.add(span.req_id, len(token_ids), first, targets, num_top)
            token_ids.extend(req.token_ids[span.num_past_tokens : num_computed])
            if num_computed > len(req.token_ids):  # its last: sampled by the step before, on the device
                assert req.pending is not None  # (step_spans counted it)
                pending.append((len(token_ids), req.pending))
                token_ids.append(0)
            if span.num_new_tokens == 1:
                positions.append(req.positions.at(span.num_past_tokens))
            else:
                positions.append(req.positions.between(span.num_past_tokens, num_computed))
            if num_computed == len(req.token_ids) + (req.pending is not None):
                step.req_ids.append(span.req_id)
                logits_rows.append(len(token_ids) - 1)
                num_outputs = req.num_output_tokens + (req.pending is not None)  # before this step's
                row = SamplingRow(
                    req.sampling, num_outputs, req.generator, allowed.get(span.req_id), req.history
                )
                step.rows.append(row)
        embeds, deepstack = step_embeddings(
            self.embed_tokens, token_ids, spans, self.requests, self.encoder_store, self.device, pending
        )
        assert self.lm_forward is not None  # (launch runs the LM only where there is one)
        step.logits = self.lm_forward(
            embeds, _step_positions(positions), spans, logits_rows, deepstack, step.prompt_logprobs
        )
        if not set(allowed) <= set(step.req_ids):
            raise StepError(
                "grammar bitmask rows for requests that do not sample: "
                f"{sorted(set(allowed) - set(step.req_ids))}"
            )
        # State changes only once the forward succeeded: a failed step leaves requests as they were.
        for span in spans:
            self.requests[span.req_id].num_computed_tokens += span.num_new_tokens

    def _encode(self, inputs: list[EncoderInput], frames: Sequence[Buffer]) -> int:
        """The family's vision encoder on all items as one batch; outputs go to the encoder store."""
        if not inputs:
            return 0
        if not self.parts.has_vision_tower:
            raise StepError("items to encode on a worker without a vision tower (--language-model-only)")
        items = []
        for item in inputs:
            names = item.shm.tensors if item.shm is not None else item.tensors
            required = self.model.item_tensors.get(item.modality)
            if required is None or not required <= names.keys():
                raise StepError(f"cannot encode {item.modality!r} item {item.mm_hash!r} with {sorted(names)}")
            items.append(self._item_tensors(item, frames))
        outputs = self.model.encode(items)
        for item, output in zip(inputs, outputs, strict=True):
            self.encoder_store.put(item.mm_hash, output)
        return len(inputs)

    def _item_tensors(self, item: EncoderInput, frames: Sequence[Buffer]) -> dict[str, torch.Tensor]:
        """The item's tensors, viewed in place: frames of the step's message, or the API's shared-memory
        ring (a reference whose chunk no longer matches fails the step, never reads garbage)."""
        if item.shm is None:
            return {name: tensor_from_frame(ref, frames) for name, ref in item.tensors.items()}
        try:
            return tensors_from_shm(item.shm, self.shm_reader.payload(item.shm))
        except StaleShmRef as exc:
            raise StepError(f"mm item {item.mm_hash!r}: {exc}") from exc


def _step_positions(parts: list[torch.Tensor | list[int]]) -> torch.Tensor:
    """The step's positions [rows, num_tokens] from each span's: a tensor, or a decode's list (one
    tensor per run of decodes, not a few small torch ops per request)."""
    tensors: list[torch.Tensor] = []
    for is_decode, run in itertools.groupby(parts, key=lambda part: isinstance(part, list)):
        items = list(run)
        if is_decode:
            tensors.append(torch.tensor(items, dtype=torch.long).T)
        else:
            tensors += [item for item in items if isinstance(item, torch.Tensor)]
    return torch.cat(tensors, dim=1)
