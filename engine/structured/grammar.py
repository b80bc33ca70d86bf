"""One constrained request's matcher, on the engine side where its tokens are known.

    grammar ready ──▶ RequestGrammar (fills next_mask) ──▶ step: next_mask is the request's bitmask row
                            ▲                                       │ worker masks logits, samples
                            └───── accept(sampled token) ◀──────────┘

The matcher advances with exactly the tokens the request keeps: a preempted request keeps its outputs and
so its matcher; a failed step ends its requests (and their matchers) instead of rolling them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row over ``vocab_size`` tokens (xgrammar's layout)."""
    return -(-vocab_size // BITS_PER_WORD)


class RequestGrammar:
    """Wraps an xgrammar ``GrammarMatcher``. ``next_mask`` always holds the tokens allowed at the
    request's next sample; ``is_complete`` says that nothing more may be generated: the grammar took a
    stop token, or it is fully matched and allows nothing but stop tokens (the request ends with
    ``stop`` there, without a step spent on sampling the stop token); ``is_dead_end`` that it allows
    no token at all (a grammar whose language is empty, such as one that only refers to itself:
    xgrammar compiles it, and no answer can satisfy it)."""

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._stop_words = np.zeros(bitmask_words(vocab_size), dtype=np.int32)
        for token_id in stop_token_ids:
            if 0 <= token_id < vocab_size:
                word, bit = divmod(token_id, BITS_PER_WORD)
                self._stop_words[word] |= np.int32(np.uint32(1 << bit).view(np.int32))
        self._mask = np.zeros((1, self._stop_words.shape[0]), dtype=np.int32)
        self.is_complete = False
        self.is_dead_end = False
        self._update()

    @property
    def next_mask(self) -> np.ndarray:
        """The allowed tokens of the next sample: one int32 row (valid until the next ``accept``)."""
        return self._mask[0]

    def forced_token(self) -> int | None:
        """The one token the grammar allows next, when it allows one only and that is no stop token
        (the engine appends it without sampling: engine/scheduler.py), else None."""
        if self.is_complete:
            return None
        words = np.flatnonzero(self._mask[0])
        if len(words) != 1:
            return None
        word = int(self._mask[0, words[0]]) & 0xFFFFFFFF
        if word & (word - 1) or self._stop_words[words[0]] & np.int32(np.uint32(word).view(np.int32)):
            return None
        return int(words[0]) * BITS_PER_WORD + word.bit_length() - 1

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it (the worker sampled
        outside the mask: the request cannot go on)."""
        if self.is_complete or not self._matcher.accept_token(token_id):
            return False
        self._update()
        return True

    def _update(self) -> None:
        if self._matcher.is_terminated():
            self.is_complete = True
            return
        self._matcher.fill_next_token_bitmask(self._mask, 0)
        if self._matcher.is_completed():
            self.is_complete = not (self._mask[0] & ~self._stop_words).any()
        self.is_dead_end = not self.is_complete and not self._mask[0].any()


def stack_rows(grammars: Sequence[RequestGrammar]) -> np.ndarray:
    """The step's bitmask, one row per grammar in order ([len(grammars), words] int32)."""
    return np.stack([grammar.next_mask for grammar in grammars])
