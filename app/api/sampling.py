"""From a chat request's sampling fields to the engine's ``SamplingParams`` of each choice: the model's
defaults filled in (``SamplingDefaults``, from its ``generation_config.json`` under
``--generation-config auto``, as vLLM), token ids checked against the vocabulary, and each choice of an
``n > 1`` request given its own seed (docs/api.md, "Sampling")."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import msgspec

from app.api.sampling_schemas import SamplingRequest
from app.errors import ContextLengthError, InvalidRequestError, MMServeError
from app.inputs.truncation import Truncation
from wire.protocol import INT64_MAX, INT64_MIN, SamplingParams

log = logging.getLogger("mmserve.api")

# generation_config.json's sampling fields vLLM reads (max_new_tokens is its default max_tokens)
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field out gets; vLLM's own values unless the model's file says else."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None  # None: up to the context length

    @classmethod
    def load(cls, model_dir: str | Path, mode: str) -> SamplingDefaults:
        """Called once when the API process starts; logs which defaults apply. ``mode`` "vllm" ignores
        the file; "auto" reads it, where it exists. A value out of range is a start-up error."""
        path = Path(model_dir) / "generation_config.json"
        if mode == "vllm" or not path.is_file():
            defaults = cls()
            why = "--generation-config vllm" if mode == "vllm" else "the model has no generation_config.json"
            log.info("sampling defaults are vLLM's (%s): %s", why, asdict(defaults))
            return defaults
        config: dict[str, Any] = json.loads(path.read_text())
        found = {name: config[name] for name in GENERATION_CONFIG_FIELDS if config.get(name) is not None}
        if not found:
            log.info("sampling defaults are vLLM's (%s sets none): %s", path, asdict(cls()))
            return cls()
        try:
            defaults = replace(cls(), **found)
            defaults.check()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: unusable sampling defaults {found}: {exc}") from exc
        log.info(
            "sampling defaults from %s (--generation-config auto): %s; vLLM's for the rest: %s",
            path,
            found,
            {f.name: getattr(defaults, f.name) for f in fields(cls) if f.name not in found},
        )
        return defaults

    def check(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError("temperature, top_p or min_p out of range")
        if self.repetition_penalty <= 0 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError("repetition_penalty or max_new_tokens out of range")
        int(self.top_k)


def sampling_params(
    body: SamplingRequest,
    defaults: SamplingDefaults,
    num_prompt_tokens: int,
    max_model_len: int,
    eos_token_ids: list[int],
    vocab_size: int,
) -> SamplingParams:
    """The first choice's parameters (``choice_sampling`` derives the others'). Raises
    ``ContextLengthError`` when prompt and completion do not fit, ``InvalidRequestError`` for a token id
    outside the vocabulary."""
    max_tokens = body.effective_max_tokens()
    if max_tokens is None and defaults.max_new_tokens is not None:
        max_tokens = min(defaults.max_new_tokens, max(max_model_len - num_prompt_tokens, 1))
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    if num_prompt_tokens >= max_model_len:  # whatever the max tokens: no room for one
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, the messages are "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. Shorten the messages."
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
            f"{max_tokens} in the completion)."
        )
    if body.min_tokens > max_tokens:  # (one given with the request is checked with the body)
        raise InvalidRequestError(
            f"min_tokens ({body.min_tokens}) must not exceed the max tokens ({max_tokens}, the default "
            f"for {num_prompt_tokens} prompt tokens): give max_tokens, or fewer min_tokens.",
            param="min_tokens",
            code="invalid_value",
        )
    top_k = defaults.top_k if body.top_k is None else body.top_k
    logit_bias = {int(key): value for key, value in (body.logit_bias or {}).items()}
    if len(logit_bias) < len(body.logit_bias or {}):  # ("7" and "07")
        [(twice, _)] = Counter(int(key) for key in body.logit_bias or {}).most_common(1)
        raise InvalidRequestError(
            f"logit_bias gives token {twice} more than one bias", param="logit_bias", code="invalid_value"
        )
    _check_vocab("logit_bias", logit_bias, vocab_size)
    _check_vocab("allowed_token_ids", body.allowed_token_ids or [], vocab_size)
    _check_vocab("stop_token_ids", body.stop_token_ids or [], vocab_size)
    _check_vocab("logprob_token_ids", body.logprob_token_ids or [], vocab_size)
    ends = {*eos_token_ids, *(body.stop_token_ids or ())}
    if body.min_tokens and body.allowed_token_ids is not None and set(body.allowed_token_ids) <= ends:
        raise InvalidRequestError(
            f"allowed_token_ids holds only end-of-sequence or stop token ids, which min_tokens "
            f"({body.min_tokens}) forbids at first: no token would be left to sample.",
            param="allowed_token_ids",
            code="invalid_value",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=top_k if top_k > 0 else None,
        seed=body.seed,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        eos_token_ids=tuple(eos_token_ids),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        num_top_logprobs=body.num_top_logprobs(),
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        repetition_penalty=(
            defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty
        ),
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        logit_bias=logit_bias or None,
        allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        logprob_token_ids=tuple(body.logprob_token_ids) if body.logprob_token_ids else None,
    )


def bad_words_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token sequences the sampler masks: each word as it would begin the
    text (its leading whitespace dropped), and after a space where that makes other tokens of the same
    count (a word in the middle of a text), as vLLM tokenizes them; a 400 naming ``bad_words`` for an id
    the model's vocabulary lacks (a tokenizer's added token past it)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        after_space = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not alone:  # (no text a tokenizer spells with no token)
            continue
        sequences.append(alone)
        if after_space and after_space[0] != alone[0] and len(after_space) == len(alone):
            sequences.append(after_space)
    _check_vocab("bad_words", [t for ids in sequences for t in ids], vocab_size)
    return tuple(dict.fromkeys(sequences))


def prompt_truncation(body: SamplingRequest, max_model_len: int) -> Truncation | None:
    """vLLM's ``truncate_prompt_tokens`` as the input path cuts the prompt: -1 keeps as many tokens as
    leave room for the max tokens asked for (one where none is); more than the context holds is a 400."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == -1:
        keep = max(max_model_len - (body.effective_max_tokens() or 1), 1)
    if keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
            "Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
            code="invalid_value",
        )
    return Truncation(keep, body.truncation_side or "left")


def choice_sampling(first: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: the first's, with seed ``seed + index`` (wrapped into int64) so a
    seeded ``n > 1`` request gives each choice its own reproducible stream, as vLLM does."""
    if index == 0 or first.seed is None:
        return first
    seed = (first.seed + index - INT64_MIN) % 2**64 + INT64_MIN
    assert INT64_MIN <= seed <= INT64_MAX
    return msgspec.structs.replace(first, seed=seed)


def _check_vocab(param: str, token_ids: Any, vocab_size: int) -> None:
    outside = sorted(t for t in token_ids if t >= vocab_size)
    if outside:
        raise InvalidRequestError(
            f"{param} names token ids outside the model's vocabulary of {vocab_size}: {outside[:8]}",
            param=param,
            code="invalid_value",
        )


LENGTH_ERROR_CODES = ("context_length_exceeded", "kv_cache_exceeded")


def reword_length_error(exc: MMServeError, words: tuple[tuple[str, str], ...]) -> None:
    """A context or KV length error (its message in chat's words: ``sampling_params`` above and
    engine/admission.py speak of messages and a completion) in another endpoint's ``words``, each pair
    (chat's, its own); any other error is left as it is."""
    if exc.code in LENGTH_ERROR_CODES:
        for chat_words, own in words:
            exc.message = exc.message.replace(chat_words, own)
