"""A test double of the engine for driving a ``ModelRunner`` step by step, without processes.

``FakeEngine`` plays the scheduler and the KV block bookkeeping: every running request computes
min(chunk_tokens, its uncomputed tokens) per step (a prefill chunk, a recompute chunk after a resume, or
one decode token); blocks come from a ``BlockAllocator`` and travel as block tables; an item is sent to
encode in the step its placeholder range is first needed unless an earlier step encoded it (and it was
not freed); a request finishes once it has max_tokens outputs, which the next step tells the worker.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from wire.protocol import (
    EncoderInput,
    MMFeature,
    NewRequestData,
    ResumedRequestData,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from workers.frames import tensor_to_frame
from workers.model_runner import ModelRunner


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    items: list[dict[str, torch.Tensor]]  # each image's processed tensors, in prompt order
    features: list[MMFeature]
    reference: list[int]  # transformers' greedy continuation
    reference_logprobs: torch.Tensor  # [NUM_NEW_TOKENS, vocab]: log_softmax of generate's raw logits


class BlockAllocator:
    """Reference-counted block ids. Released blocks go to the front of the free list, so the next
    allocation reuses (and overwrites) them; ``shuffle_seed`` makes tables non-contiguous."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self.free: deque[int] = deque(ids)
        self.refs: dict[int, int] = {}

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise RuntimeError(f"out of KV blocks: {num_blocks} wanted, {len(self.free)} free")
        ids = [self.free.popleft() for _ in range(num_blocks)]
        self.refs.update(dict.fromkeys(ids, 1))
        return ids

    def share(self, ids: list[int]) -> list[int]:
        """A prefix-cache hit: take references to blocks whose K/V is still there (even if freed)."""
        for block_id in ids:
            if block_id not in self.refs:
                self.free.remove(block_id)
            self.refs[block_id] = self.refs.get(block_id, 0) + 1
        return list(ids)

    def release(self, ids: list[int]) -> None:
        for block_id in reversed(ids):
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                del self.refs[block_id]
                self.free.appendleft(block_id)


class FakeEngine:
    def __init__(self, runner: ModelRunner, chunk_tokens: int = 1 << 30, shuffle_seed: int | None = None):
        self.runner, self.chunk_tokens = runner, chunk_tokens
        self.block_size = runner.block_size
        self.allocator = BlockAllocator(runner.num_kv_blocks, shuffle_seed)
        self.step_id = 0
        self.prompts: dict[str, Prompt] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.num_computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.unsent: set[str] = set()  # new requests, sent in full in their first step
        self.resuming: set[str] = set()
        self.paused: set[str] = set()  # preempted and not resumed yet
        self.encoded: set[str] = set()
        self.finished: list[str] = []  # told to the worker in the next step
        self.preempted: list[str] = []  # likewise
        self.done: set[str] = set()
        self.to_free: list[str] = []
        self.history: list[tuple[dict[str, int], RunnerOutput]] = []
        self.copies: list[tuple[int, int, int]] = []  # partial prefix hits, made by the next step

    def add(
        self,
        req_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        prefix: tuple[str, int] | None = None,
        num_copied: int = 0,
    ) -> None:
        """``prefix=(other_req_id, num_blocks)``: the first num_blocks of the other request's table
        hold this prompt's first tokens (the caller makes sure they do); with ``num_copied``, so do the
        first tokens of its next block, which the first step copies into a block of this request's."""
        self.prompts[req_id], self.sampling[req_id] = prompt, sampling
        self.outputs[req_id], self.logprobs[req_id] = [], []
        self.tables[req_id], self.num_computed[req_id] = [], 0
        if prefix is not None:
            other, num_blocks = prefix
            self.tables[req_id] = self.allocator.share(self.tables[other][:num_blocks])
            self.num_computed[req_id] = num_blocks * self.block_size
            if num_copied:
                [destination] = self.allocator.allocate(1)
                self.copies.append((self.tables[other][num_blocks], destination, num_copied))
                self.tables[req_id].append(destination)
                self.num_computed[req_id] += num_copied
        self.unsent.add(req_id)

    def free(self, mm_hashes: list[str]) -> None:
        self.to_free += mm_hashes
        self.encoded -= set(mm_hashes)

    def preempt(self, req_id: str) -> list[int]:
        """Take the request's blocks back (the next allocation reuses them); returns them."""
        blocks, self.tables[req_id] = self.tables[req_id], []
        self.allocator.release(blocks)
        self.num_computed[req_id] = 0
        self.paused.add(req_id)
        self.preempted.append(req_id)
        return blocks

    def resume(self, req_id: str) -> None:
        self.paused.remove(req_id)
        self.resuming.add(req_id)

    @property
    def running(self) -> list[str]:
        return [r for r in self.prompts if r not in self.done and r not in self.paused]

    def step(self) -> RunnerOutput:
        scheduled: dict[str, int] = {}
        new_requests: list[NewRequestData] = []
        resumed: list[ResumedRequestData] = []
        new_block_ids: dict[str, list[int]] = {}
        encoder_inputs: list[EncoderInput] = []
        frames: list = [b""]
        for req_id in self.running:
            prompt, start, table = self.prompts[req_id], self.num_computed[req_id], self.tables[req_id]
            num_known = len(prompt.input_ids) + len(self.outputs[req_id])
            num_tokens = min(self.chunk_tokens, num_known - start)
            scheduled[req_id] = num_tokens
            num_blocks = -(-(start + num_tokens) // self.block_size)
            fresh = self.allocator.allocate(max(0, num_blocks - len(table)))
            table.extend(fresh)
            if req_id in self.unsent:
                new_requests.append(
                    NewRequestData(
                        req_id, prompt.input_ids, prompt.features, self.sampling[req_id], list(table), start
                    )
                )
            elif req_id in self.resuming:
                resumed.append(ResumedRequestData(req_id, list(table), start))
            elif fresh:
                new_block_ids[req_id] = fresh
            for feat, tensors in zip(prompt.features, prompt.items, strict=True):
                needed = feat.offset < start + num_tokens and start < feat.end
                if needed and feat.mm_hash not in self.encoded:
                    refs = {}
                    for name, tensor in tensors.items():
                        refs[name], buf = tensor_to_frame(tensor, len(frames))
                        frames.append(buf)
                    encoder_inputs.append(EncoderInput(feat.mm_hash, "image", refs))
                    self.encoded.add(feat.mm_hash)
        sched = SchedulerOutput(
            self.step_id,
            new_requests,
            scheduled,
            encoder_inputs,
            self.to_free,
            self.finished,
            resumed_requests=resumed,
            new_block_ids=new_block_ids,
            preempted_req_ids=self.preempted,
            kv_copies=self.copies,
        )
        out = self.runner.execute(sched, frames)
        self.history.append((scheduled, out))
        self.step_id, self.to_free, self.finished, self.preempted = self.step_id + 1, [], [], []
        self.copies = []
        self.unsent -= set(scheduled)
        self.resuming -= set(scheduled)
        for req_id, num_tokens in scheduled.items():
            self.num_computed[req_id] += num_tokens
        for req_id, token_id, logprobs in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
            self.outputs[req_id].append(token_id)
            self.logprobs[req_id].append(logprobs)
            if len(self.outputs[req_id]) >= self.sampling[req_id].max_tokens:
                self.finished.append(req_id)
                self.done.add(req_id)
                self.allocator.release(self.tables[req_id])
        return out

    def decode_overlapped(self, num_steps: int) -> list[RunnerOutput]:
        """``num_steps`` decode steps of every running request, each step launched before the one before
        is finished, as the worker runs them with ``--worker-step-overlap`` (docs/architecture.md,
        "Engine step"): each request computes the token its previous step sampled, which is still on
        the device. Every running request must be past its prompt and sampling, with room left under
        ``max_tokens`` for all ``num_steps`` (nothing finishes here)."""
        outs: list[RunnerOutput] = []
        in_flight = None
        for _ in range(num_steps):
            scheduled = dict.fromkeys(self.running, 1)
            new_block_ids: dict[str, list[int]] = {}
            for req_id in scheduled:
                assert not self.unsent and not self.resuming and not self.to_free and not self.finished
                if self.num_computed[req_id] % self.block_size == 0:
                    new_block_ids[req_id] = self.allocator.allocate(1)
                    self.tables[req_id] += new_block_ids[req_id]
                self.num_computed[req_id] += 1
            sched = SchedulerOutput(self.step_id, [], scheduled, [], [], [], new_block_ids=new_block_ids)
            self.step_id += 1
            launched = self.runner.launch(sched, [b""])
            if in_flight is not None:
                outs.append(self._take(self.runner.finish(in_flight)))
            in_flight = self.runner.sample(launched)
        if in_flight is not None:
            outs.append(self._take(self.runner.finish(in_flight)))
        return outs

    def _take(self, out: RunnerOutput) -> RunnerOutput:
        for req_id, token_id, logprobs in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
            self.outputs[req_id].append(token_id)
            self.logprobs[req_id].append(logprobs)
            assert len(self.outputs[req_id]) < self.sampling[req_id].max_tokens, (
                "decode_overlapped finishes none"
            )
        return out

    def run(self) -> dict[str, list[int]]:
        while self.running:
            self.step()
        if self.finished or self.to_free or self.preempted:
            self.step()  # tell the worker, as the next real step would
        return self.outputs
