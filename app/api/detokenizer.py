"""Incremental detokenization of one request's output, with stop strings.

Each ``push`` decodes a small window of tokens, not the whole output (the prefix/read offsets of vLLM
and TGI)::

    token_ids:  ... | prefix_offset ........ read_offset ........ len(token_ids)
                      └─ decoded as context ─┘└─ new text, once it decodes cleanly ─┘

The first window starts after ``context``, ids before the output (a raw prompt's), where given.
Text is released only once the window no longer ends in an incomplete UTF-8 sequence (decoded as
U+FFFD), so byte-level BPE output never streams half a character. Released text then passes a second
hold-back: while the tail could still grow into a stop string it is kept, so a stop string is never
partly streamed. Invariants: ``read_offset`` is always at a character boundary; released text holds
no stop string nor the start of one that could still complete, so only unreleased text is searched.
With ``min_tokens``, as in vLLM, a stop string counts only where it ends in the text of a token past the
first ``min_tokens``: until then, a stop string already whole goes out as text, and only the start of
one that could still complete is held back.
"""

from __future__ import annotations

from typing import Any

from app.api.token_spelling import spelling_of

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns the token ids of one request into text deltas, in the order the engine produces them.

    ``push`` is called with each batch of new ids; ``flush`` once when the request finished without a
    stop string (it releases held-back text), or ``push_ending_on_stop_token`` for the last batch of a
    request that a stop token ended. After a stop string matched, ``stopped`` is True, ``stop_str``
    names it, ``text`` ends right before it (or after it with ``include_stop_str``) and further pushes
    return "".
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str: bool = False,
        min_tokens: int = 0,
        context: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop or [] if s]
        self.include_stop_str = include_stop_str
        self.stopped = False
        self.stop_str: str | None = None
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._released: list[str] = []
        self._pending = ""  # decoded, held back while it could be the start of a stop string
        self._uncounted = 0  # chars of ``_pending`` from the first ``min_tokens`` tokens: no stop ends there
        self._finished = False
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)
        # The Rust tokenizer's decode skips transformers' Python wrapper: several times faster per call.
        # (So does not apply ``clean_up_tokenization_spaces``, as in vLLM.)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        # ids before the output (a raw prompt's last ones): its first tokens decode after them, as they
        # would in the prompt's text (a SentencePiece "▁Paris" keeps its space); none where they end in
        # half a character
        self._context = list(context or [])
        if self._context and self._decode(self._context).endswith(_REPLACEMENT):
            self._context = []

    @property
    def text(self) -> str:
        """The output text released so far (held-back text excluded)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def push(self, token_ids: list[int]) -> str:
        """Adds new token ids; returns the text that may be sent now (often ""). Several ids in one push
        end where they would have one by one: with stop strings, ``token_ids`` ends with the id that
        completed one (a batch is decoded at once, and again id by id only where it holds a stop string
        or ends in half a character)."""
        if self.stopped or self._finished:
            return ""
        before = (
            len(self.token_ids),
            self._prefix_offset,
            self._read_offset,
            self._pending,
            self._uncounted,
            len(self._released),
        )
        self.token_ids.extend(token_ids)
        released = self._release(self._decode_new(final=False), final=False)
        if len(token_ids) == 1 or not self.stop:
            return released
        if not self.stopped and self._read_offset == len(self.token_ids):
            return released  # decoded whole, and no stop string in it: one decode for the batch
        # a stop string in the batch, or a tail held back (half a character) that may hide one: again
        # one id at a time, so that ``token_ids`` ends with the one that completed it
        num_ids, self._prefix_offset, self._read_offset, self._pending, self._uncounted, num_released = before
        del self.token_ids[num_ids:], self._released[num_released:]
        self.stopped, self.stop_str = False, None
        pieces = []
        for token_id in token_ids:
            self.token_ids.append(token_id)
            pieces.append(self._release(self._decode_new(final=False), final=False))
            if self.stopped:
                break
        return "".join(pieces)

    def push_ending_on_stop_token(self, token_ids: list[int]) -> str:
        """``push`` then ``flush`` for the request's last ids, whose last is the stop token that ended it
        (an EOS or one of ``stop_token_ids``): as in vLLM, that token counts among ``token_ids`` but
        adds no text, unless ``include_stop_str`` (``include_stop_str_in_output``)."""
        if self.include_stop_str or not token_ids:
            return self.push(token_ids) + self.flush()
        *body, stop_token = token_ids
        text = self.push(body) if body else ""
        if self.stopped or self._finished:  # a stop string came first
            return text
        text += self.flush()
        self.token_ids.append(stop_token)  # after the flush: never decoded
        return text

    def flush(self) -> str:
        """Called once when the request finished (EOS, length): decodes what was waiting for more bytes
        and releases every held-back character; a stop string may still match in it."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_fn(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the tokens past ``read_offset``, decoded with the preceding window as context (so
        that decoders that strip a leading space only ever strip it from the context)."""
        if self._read_offset == len(self.token_ids):
            return ""
        context = self._context if self._prefix_offset == 0 else []  # (the window's start: the output's)
        prefix_text = self._decode(context + self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(context + self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. only special tokens, skipped
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # an incomplete UTF-8 sequence (or a real U+FFFD: released with the next token)
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _release(self, new_text: str, *, final: bool) -> str:
        pending = self._pending + new_text
        counted = len(self.token_ids) > self.min_tokens
        if self.stop and counted:
            # only a stop string that ends past the text of the first ``min_tokens`` tokens
            starts = [(s, max(0, self._uncounted - len(s) + 1)) for s in self.stop]
            matches = [(pos, s) for s, start in starts if (pos := pending.find(s, start)) >= 0]
            if matches:
                pos, stop_str = min(matches, key=lambda match: (match[0], -len(match[1])))
                self.stopped, self.stop_str = True, stop_str
                return self._emit(pending[: pos + len(stop_str) if self.include_stop_str else pos], "")
        num_held_chars = 0 if final else self._stop_prefix_chars(pending)
        cut = len(pending) - num_held_chars
        self._uncounted = max(0, self._uncounted - cut) if counted else num_held_chars
        return self._emit(pending[:cut], pending[cut:])

    def _emit(self, delta: str, pending: str) -> str:
        self._pending = pending
        if delta:
            self._released.append(delta)
        return delta

    def _stop_prefix_chars(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of a stop string."""
        for size in range(min(self._max_stop_chars - 1, len(pending)), 0, -1):
            tail = pending[-size:]
            if any(len(s) > size and s.startswith(tail) for s in self.stop):
                return size
        return 0

    # ------------------------------------------------------------------ logprobs helpers

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes a single token stands for (may be part of a UTF-8 character)."""
        return spelling_of(self.tokenizer).token_bytes(token_id)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's text for logprobs (app/api/token_spelling.py)."""
        return spelling_of(self.tokenizer).token_strings(token_ids)
