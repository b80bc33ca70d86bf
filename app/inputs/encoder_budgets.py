"""The encoder budgets, derived from the model as vLLM's ``compute_encoder_budget`` does.

The largest item the checkpoint's processor settings can produce (the family says how many placeholder
tokens that is) sets the floor of both defaults:

    compute budget per step = --encoder-compute-budget-tokens, else max(--max-num-batched-tokens, largest)
    cache size              = --encoder-cache-tokens,          else max(8192, largest)

A budget set explicitly below the largest item is honoured: start-up warns, naming the largest item, and
a request with an item above the budget gets 400 ``mm_item_too_large`` naming the flag to raise (the
scheduler's admission check). ``--disable-chunked-mm-input`` needs one step to hold the largest item
whole, so a smaller ``--max-num-batched-tokens`` is a start-up error.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.settings import DEFAULT_ENCODER_CACHE_TOKENS, Settings
from workers.families import largest_item_tokens


@dataclass(frozen=True)
class EncoderBudgets:
    largest_item_tokens: int
    encoder_cache_tokens: int
    encoder_compute_budget_tokens: int


def derive_encoder_budgets(settings: Settings) -> EncoderBudgets:
    largest = largest_item_tokens(settings.model, settings.max_video_frames)
    cache = settings.encoder_cache_tokens
    compute = settings.encoder_compute_budget_tokens
    return EncoderBudgets(
        largest_item_tokens=largest,
        encoder_cache_tokens=max(DEFAULT_ENCODER_CACHE_TOKENS, largest) if cache is None else cache,
        encoder_compute_budget_tokens=max(settings.max_num_batched_tokens, largest)
        if compute is None
        else compute,
    )


def budget_warnings(settings: Settings, budgets: EncoderBudgets) -> list[str]:
    """One line per explicit budget below the largest item (such items will be refused with 400)."""
    largest = budgets.largest_item_tokens
    warnings = []
    for flag, value in (
        ("--encoder-cache-tokens", settings.encoder_cache_tokens),
        ("--encoder-compute-budget-tokens", settings.encoder_compute_budget_tokens),
    ):
        if value is None or (flag == "--encoder-cache-tokens" and value == 0):  # 0: caching off, unbounded
            continue
        if value < largest:
            warnings.append(
                f"{flag} {value} is below this model's largest image ({largest} tokens): requests with "
                f"images above {value} tokens will get 400 mm_item_too_large"
            )
    return warnings


def startup_error(settings: Settings, budgets: EncoderBudgets) -> str | None:
    """Settings that cannot work together, found before any process starts."""
    largest = budgets.largest_item_tokens
    if settings.disable_chunked_mm_input and largest > settings.max_num_batched_tokens:
        return (
            f"--disable-chunked-mm-input needs --max-num-batched-tokens of at least {largest} (the "
            f"tokens of this model's largest image); it is {settings.max_num_batched_tokens}"
        )
    return None
