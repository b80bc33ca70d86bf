"""Token sampling for one step, batched over the requests that sample.

Order of operations on each row of logits (float32, [vocab]), vLLM's (docs/api.md, "Sampling"):
1. logprobs, if asked, are ``log_softmax`` of the raw logits (before any masking, bias or penalty);
2. structured output: tokens the request's grammar does not allow are masked (its bitmask row from the
   engine, applied with xgrammar's kernel for the device);
3. ``allowed_token_ids`` masks every other id; ``bad_words`` mask each sequence's last id where the
   output ends with the ids before it (vLLM's rule); ``logit_bias`` is added;
4. min_tokens: eos and stop token ids are masked while fewer than ``min_tokens`` outputs exist;
5. penalties: ``repetition_penalty`` over the ids in prompt or output (transformers' rule: a positive
   logit is divided by it, a negative one multiplied), then ``frequency_penalty`` x each id's count in
   the output and ``presence_penalty`` once per id in the output are subtracted;
6. temperature 0 -> argmax; else temperature, min_p (drop tokens under ``min_p`` x the top probability),
   top-k, top-p, then an exponential race ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the
   request's own generator, which samples exactly from ``probs`` and makes a seeded request's output
   independent of the batch it ran in.

Every step is batched over the rows that need it; a batch whose requests ask for none of 3-6 pays
nothing for them. Penalties touch only the ids a request has seen, whose output counts are kept per
request (``TokenHistory``) and updated with each new token, not recounted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wire.protocol import Logprob, SamplingParams, TokenLogprobs
from workers.host_copies import HostCopies, to_device

_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    num_output_tokens: int  # outputs generated before this step
    generator: torch.Generator  # the request's own (seeded) or the worker-wide one
    allowed: torch.Tensor | None = None  # its grammar's bitmask row (int32 words); None: unconstrained
    history: TokenHistory | None = None  # its tokens, for penalties (required when it has any)


class TokenHistory:
    """One request's token ids as the penalties read them: the distinct ids of its prompt and output (the
    prompt's first) and each one's count in the output, kept up to date as outputs are appended (each
    new token is counted once, O(1)), in numpy arrays a step concatenates without converting Python
    lists. Built on first use: a request without penalties never builds it. ``token_ids`` is the
    request's own list (prompt, then outputs), read, never changed here.

    Penalties then touch only these ids (a gather and a scatter, as transformers applies its repetition
    penalty), not the whole vocabulary: a request sees a few hundred distinct ids, a vocabulary has
    thousands to hundreds of thousands."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self._ids = np.empty(0, dtype=np.int64)  # distinct ids in prompt or output, then spare room
        self._counts = np.empty(0, dtype=np.float32)  # each id's count in the output (0: prompt only)
        self._num_ids = 0
        self._position: dict[int, int] = {}  # id -> its index in _ids
        self._num_counted: int | None = None  # outputs counted; None: not built

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._num_ids]

    @property
    def output_counts(self) -> np.ndarray:
        return self._counts[: self._num_ids]

    def update(self, vocab_size: int) -> None:
        """Called before each penalised sampling. Ids outside the vocabulary (none in practice: the
        engine checks prompts, sampled ids come from the logits) are left out."""
        if self._num_counted is None:
            prompt = list(
                dict.fromkeys(t for t in self.token_ids[: self.num_prompt_tokens] if t < vocab_size)
            )
            self._ids = np.array(prompt + [0] * 64, dtype=np.int64)
            self._counts = np.zeros(len(self._ids), dtype=np.float32)
            self._num_ids = len(prompt)
            self._position = {token_id: i for i, token_id in enumerate(prompt)}
            self._num_counted = 0
        for token_id in self.token_ids[self.num_prompt_tokens + self._num_counted :]:
            position = self._position.get(token_id)
            if position is None and token_id < vocab_size:
                if self._num_ids == len(self._ids):  # full: double the room
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                position = self._position[token_id] = self._num_ids
                self._ids[position] = token_id
                self._num_ids += 1
            if position is not None:
                self._counts[position] += 1.0
        self._num_counted = len(self.token_ids) - self.num_prompt_tokens


def make_generator(seed: int | None, device: torch.device, fallback: torch.Generator) -> torch.Generator:
    """Called once when a request arrives: its own generator when seeded, else the shared one."""
    if seed is None:
        return fallback
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if device.type == "cuda" else fold_seed(seed))
    return gen


_MASK64 = (1 << 64) - 1


def fold_seed(seed: int) -> int:
    """A 64-bit seed as 32 bits in which every bit of it counts. The CPU generator (Mersenne Twister)
    keeps only the low 32 bits of its seed, so 1 and 2**32 + 1 would give one stream (CUDA's Philox
    takes all 64): the seed is mixed (splitmix64's finaliser) and its halves xored."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of ``logits`` ([len(rows), vocab], float32)."""
    return sample_on_device(logits, rows).to_host()


class Sampled:
    """A step's sampled tokens, and the logprobs its rows asked for, on the device; their copy to the
    host is the last work the step puts on its stream, and ``to_host`` waits for that copy only, not
    for work queued after it (the next step's forward, on a GPU: docs/architecture.md, "Engine step")."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        want_logprobs: list[int],
        num_top: list[int],
        logprob_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.token_ids = token_ids  # [rows] int64, on the device: the next step may read it there
        self._want_logprobs = want_logprobs  # the rows that asked, in order
        self._num_top = num_top  # each of those rows' number of top logprobs
        self._copies = HostCopies([token_ids, *(logprob_tensors or ())])

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        host = self._copies.wait()
        token_list: list[int] = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self._want_logprobs:
            sampled, top_values, top_ids = (t.tolist() for t in host[1:])
            for k, i in enumerate(self._want_logprobs):
                n = self._num_top[k]
                logprobs[i] = TokenLogprobs(
                    sampled=Logprob(token_id=token_list[i], logprob=sampled[k]),
                    top=[
                        Logprob(token_id=t, logprob=lp)
                        for t, lp in zip(top_ids[k][:n], top_values[k][:n], strict=True)
                    ],
                )
        return token_list, logprobs


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> Sampled:
    """Sample one token per row of ``logits`` ([len(rows), vocab], float32), leaving the tokens on the
    device (no wait for the device here)."""
    num_rows, vocab_size = logits.shape
    assert num_rows == len(rows)
    want = [i for i, row in enumerate(rows) if row.params.num_top_logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None

    logits = logits.clone()
    _mask_grammars(logits, rows)
    _mask_allowed_ids(logits, rows)
    _mask_bad_words(logits, rows)
    _add_logit_bias(logits, rows)
    _mask_min_tokens(logits, rows)
    _apply_penalties(logits, rows)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, row in enumerate(rows) if row.params.temperature >= _GREEDY_TEMPERATURE]
    if random_rows:
        idx = to_device(random_rows, logits.device, torch.long)
        sampled = _sample_random(logits.index_select(0, idx), [rows[i] for i in random_rows])
        token_ids = token_ids.index_copy(0, idx, sampled)
    if raw_logprobs is None:
        return Sampled(token_ids, [], [], None)
    # the raw logprobs (before any mask) of each asking row: its token's and its top ones, or those of
    # the ids it names (``logprob_token_ids``, in its order)
    num_top = [_num_alternatives(rows[i].params) for i in want]
    idx = to_device(want, logits.device, torch.long)
    asked = raw_logprobs.index_select(0, idx)
    sampled_logprobs = asked.gather(1, token_ids.index_select(0, idx).unsqueeze(1)).squeeze(1)
    top_values, top_ids = asked.topk(min(max(num_top), vocab_size), dim=-1)
    named = [k for k, i in enumerate(want) if rows[i].params.logprob_token_ids]
    if named:  # their rows of the top tensors hold the named ids (padded with id 0, cut on the host)
        ids = torch.zeros((len(named), top_ids.shape[1]), dtype=torch.long)
        for r, k in enumerate(named):
            named_ids = rows[want[k]].params.logprob_token_ids or ()
            ids[r, : len(named_ids)] = torch.tensor(named_ids, dtype=torch.long)
        ids = to_device(ids, logits.device, torch.long)
        at = to_device(named, logits.device, torch.long)
        top_ids = top_ids.index_copy(0, at, ids)
        top_values = top_values.index_copy(0, at, asked.index_select(0, at).gather(1, ids))
    return Sampled(token_ids, want, num_top, (sampled_logprobs, top_values, top_ids))


def _num_alternatives(params: SamplingParams) -> int:
    """A logprobs row's alternatives: the ids it names, or its number of top ones."""
    return len(params.logprob_token_ids) if params.logprob_token_ids else params.num_top_logprobs or 0


def _mask_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on every token a constrained row's grammar does not allow (token ids past its bitmask
    included: the engine sizes it to the whole vocabulary). One bitmask for the whole batch (every bit
    set on an unconstrained row) and one kernel call: about half the time of filling it row by row and
    naming the constrained rows to the kernel."""
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
    if not constrained:
        return
    import xgrammar  # only a worker that gets a constrained request loads it

    allowed = torch.stack([rows[i].allowed for i in constrained])  # type: ignore[misc]
    if len(constrained) == len(rows):
        bitmask = allowed
    else:
        bitmask = torch.full((len(rows), allowed.shape[1]), -1, dtype=torch.int32)
        bitmask.index_copy_(0, torch.tensor(constrained), allowed)
    bitmask = to_device(bitmask, logits.device, torch.int32)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])


def _mask_allowed_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on every id outside a row's ``allowed_token_ids``."""
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return
    vocab_size = logits.shape[1]
    keep = torch.zeros((len(limited), vocab_size), dtype=torch.bool)  # made here, then copied once
    for k, i in enumerate(limited):
        ids = [t for t in rows[i].params.allowed_token_ids or () if t < vocab_size]
        keep[k, ids] = True
    keep = to_device(keep, logits.device, torch.bool)
    idx = to_device(limited, logits.device, torch.long)
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))


def _mask_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on each bad word's last id where the row's output ends with the ids before it (a one-token
    word: always), as vLLM's rule reads the output alone, in one indexed fill. The row's history holds
    every output by now, its last included: a step is sampled once the step before it finished, which
    appended the token it sampled (workers/model_runner.py)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        if not row.params.bad_words:
            continue
        history = row.history
        assert history is not None  # (the runner gives every request one)
        token_ids = history.token_ids  # read in place: only each word's prefix length of its tail
        num_outputs = len(token_ids) - history.num_prompt_tokens
        assert num_outputs == row.num_output_tokens, "bad words read an output not appended yet"
        for ids in row.params.bad_words:
            *prefix, last = ids
            if prefix and (num_outputs < len(prefix) or token_ids[len(token_ids) - len(prefix) :] != prefix):
                continue
            if last < vocab_size:
                row_idx.append(i)
                token_idx.append(last)
    if row_idx:
        device = logits.device
        index = (to_device(row_idx, device, torch.long), to_device(token_idx, device, torch.long))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each row's ``logit_bias`` added in one indexed add (ids outside the vocabulary were refused)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id < vocab_size:
                row_idx.append(i)
                token_idx.append(token_id)
                biases.append(bias)
    if row_idx:
        device = logits.device
        index = (to_device(row_idx, device, torch.long), to_device(token_idx, device, torch.long))
        logits.index_put_(index, to_device(biases, device, logits.dtype), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties on the rows that ask for any: one gather of every
    penalised row's seen ids, the arithmetic on those, one scatter back."""
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return
    vocab_size = logits.shape[1]
    histories = [rows[i].history for i in penalised]
    for history in histories:
        assert history is not None  # (the runner gives every request a history)
        history.update(vocab_size)
    num_ids = np.array([len(h.ids) for h in histories])  # type: ignore[union-attr]
    params = [rows[i].params for i in penalised]

    def per_id(name: str) -> np.ndarray:
        return np.repeat(np.array([getattr(p, name) for p in params], dtype=np.float32), num_ids)

    # The per-id arithmetic that does not need the logits runs in numpy, on the few ids involved.
    counts = np.concatenate([h.output_counts for h in histories])  # type: ignore[union-attr]
    subtract = per_id("frequency_penalty") * counts + per_id("presence_penalty") * (counts > 0)
    device = logits.device
    row_index = np.repeat(np.array(penalised, dtype=np.int64), num_ids)
    ids = np.concatenate([h.ids for h in histories])  # type: ignore[union-attr]
    index = (to_device(row_index, device, torch.long), to_device(ids, device, torch.long))
    scores = logits[index]
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = to_device(per_id("repetition_penalty"), device, logits.dtype)
        scores = torch.where(scores > 0, scores / repetition, scores * repetition)
    logits.index_put_(index, scores - to_device(subtract, device, logits.dtype))


def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on the eos and stop token ids of every row short of its ``min_tokens``, in one indexed write."""
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            banned = [
                t for t in (*row.params.eos_token_ids, *row.params.stop_token_ids) if 0 <= t < vocab_size
            ]
            row_idx += [i] * len(banned)
            token_idx += banned
    if row_idx:
        device = logits.device
        index = (to_device(row_idx, device, torch.long), to_device(token_idx, device, torch.long))
        logits.index_put_(index, torch.full((len(row_idx),), float("-inf"), device=device))


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = to_device([row.params.temperature for row in rows], device, logits.dtype)
    logits = logits / temperature.unsqueeze(1)
    if any(row.params.min_p > 0 for row in rows):
        probs = logits.softmax(dim=-1)
        min_p = to_device([row.params.min_p for row in rows], device, logits.dtype)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    top_k = [min(max(row.params.top_k, 1), vocab_size) if row.params.top_k else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab_size, device=device).unsqueeze(0)
        remove = ranks >= to_device(top_k, device, torch.long).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs_sorted = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p. The first always stays,
        # also where top_p rounds to 0 in the logits' dtype (1e-300 in float32).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        p = to_device(top_p, device, logits.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (ranks > 0), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)

    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    for i, row in enumerate(rows):
        q[i].exponential_(generator=row.generator)
    # A zero draw would make 0/0 = nan for a masked token, and argmax favours nan.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    sampled = (probs / q).argmax(dim=-1)
    # A logit that overflowed (an extreme repetition_penalty or temperature) makes its row's softmax nan:
    # that row takes its top logit, which is never a masked token.
    overflowed = probs.isnan().any(dim=-1)
    return torch.where(overflowed, logits.argmax(dim=-1), sampled)
