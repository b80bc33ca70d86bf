"""Admission: why a request is refused before it is queued. It could never run (400: longer than the
model or the KV pool allows, an image above a budget that one step must fit), or the waiting queue is
full (429; requests already queued are never dropped for a new one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler's config; engine.scheduler imports this module
    from engine.step_plan import SchedulerConfig


@dataclass(frozen=True)
class AdmissionError:
    message: str
    code: str  # OpenAI-style error code
    http_status: int = 400


def queue_full_error(config: SchedulerConfig, num_waiting: int) -> AdmissionError | None:
    """429 when ``num_waiting`` requests already wait (``--max-waiting-requests``)."""
    limit = config.max_waiting_requests
    if limit is None or num_waiting < limit:
        return None
    return AdmissionError(
        f"The server is busy: {num_waiting} requests are waiting (--max-waiting-requests {limit}). "
        "Retry shortly.",
        "too_many_requests",
        http_status=429,
    )


def admission_error(
    config: SchedulerConfig,
    num_waiting: int,
    encoder_cache_enabled: bool,
    prompt_len: int,
    max_tokens: int,
    mm_sizes: list[int],
    mm_modalities: Sequence[str] = (),
) -> AdmissionError | None:
    """Why a request of ``prompt_len`` tokens asking for ``max_tokens``, with items of ``mm_sizes``
    encoder tokens (``mm_modalities``: their kinds, for the message; images when not given), is
    refused, or None."""
    busy = queue_full_error(config, num_waiting)
    if busy is not None:
        return busy
    if prompt_len + max_tokens > config.max_model_len:
        return AdmissionError(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion).",
            "context_length_exceeded",
        )
    kv_pool_tokens = config.num_kv_blocks * config.block_size
    if prompt_len + max_tokens > kv_pool_tokens:
        return AdmissionError(
            f"The request needs up to {prompt_len + max_tokens} tokens of KV cache ({prompt_len} in the "
            f"messages, {max_tokens} in the completion), more than the whole KV pool holds "
            f"({kv_pool_tokens} tokens).",
            "kv_cache_exceeded",
        )
    for num_tokens, modality in zip(mm_sizes, [*mm_modalities, *["image"] * len(mm_sizes)], strict=False):
        flag = _budget_below(config, encoder_cache_enabled, num_tokens)
        if flag is not None:
            smaller = "fewer frames (fps, num_frames) or" if modality == "video" else "a smaller image or"
            return AdmissionError(
                f"{'A video' if modality == 'video' else 'An image'} of this request needs {num_tokens} "
                f"encoder tokens, more than {flag} allows; raise {flag} to at least {num_tokens} (or send "
                f"{smaller} mm_processor_kwargs.max_pixels).",
                "mm_item_too_large",
            )
    return None


def _budget_below(config: SchedulerConfig, encoder_cache_enabled: bool, num_tokens: int) -> str | None:
    """The flag whose budget an item of ``num_tokens`` embeddings exceeds (it could never be
    scheduled: one item is encoded whole, in one step), or None."""
    if num_tokens > config.encoder_compute_budget_tokens:
        return f"--encoder-compute-budget-tokens ({config.encoder_compute_budget_tokens})"
    if encoder_cache_enabled and num_tokens > config.encoder_cache_tokens:
        return f"--encoder-cache-tokens ({config.encoder_cache_tokens})"
    if config.disable_chunked_mm_input and num_tokens > config.max_num_batched_tokens:
        return f"--max-num-batched-tokens ({config.max_num_batched_tokens}) with --disable-chunked-mm-input"
    return None
