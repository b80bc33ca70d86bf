"""Stages 3 and 6 of the request path, render and tokenize (docs/architecture.md, "Request path"), at
the cost of a dictionary lookup for a prompt seen before, and without tokenizing placeholders.

**Tokenize.** ``FamilyProcessor.tokenize`` writes each media token out as its item's layout says (LLaVA:
576 image tokens; a Qwen3-VL video: a timestamp and its frame group's placeholders per group) and
tokenizes the result, so the placeholders were most of the tokenizer's work. Media tokens are added
tokens: the tokenizer splits added tokens out of the text before anything else runs and tokenizes the
text between them on its own, and the pieces a family writes between placeholders lie between such
tokens too. So tokenizing the rendered prompt, which has one media token per item, and writing each
media token's id out as placeholder ids and the pieces' own ids gives the same ids;
``tests/integration/test_prompt_builder.py`` checks them against the HF processor's ``input_ids`` for
LLaVA and the Qwen families. Where that reasoning does not cover a prompt (an item of 0 tokens, a BOS
check the short prompt could answer differently, mismatched items) ``tokenize`` hands the prompt to the
family's own method, which answers or raises exactly as before.

**Caches.** Two LRUs bounded in characters, used from the event loop only: rendered messages -> prompt
text (kept only when the chat templates cannot depend on anything but the messages: one that reads the
clock through ``strftime_now`` is rendered every time), and prompt text -> its ids with one id per
item. A client re-sending the same conversation with the same media renders and tokenizes nothing. The
templates are the process's for its lifetime (``--chat-template`` is read once, at start-up), so a
cached render never outlives the template that made it.

**Long prompts.** Tokenizing takes about half a second per million characters, which on the event loop
would stall every other request of the API process; the input processor tokenizes a prompt over
``OFF_LOOP_PROMPT_CHARS`` in a thread instead (the tokenizer releases the GIL). So the caches lock, and
the tokenizer is only ever called the same way (no truncation or padding set per call), which its Rust
side allows from two threads at once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from workers.families.processing import DEFAULT_TEMPLATE, ItemLayout, TemplateOptions, Tokenized

if TYPE_CHECKING:
    from workers.families.processing import FamilyProcessor

DEFAULT_MAX_CACHED_CHARS = 2 << 20  # per cache
MAX_CACHED_PIECES = 4096  # texts between a video's placeholders (Qwen3-VL: "<1.5 seconds>" and the like)
OFF_LOOP_PROMPT_CHARS = 32_768  # longer prompts are tokenized in a thread (about 15 ms and more)

V = TypeVar("V")

# A message as the chat template sees it, hashable: (role, text) or (role, ((kind, text), ...)).
MessagesKey = tuple[tuple[str, str | tuple[tuple[str, str], ...]], ...]


class _CharBoundedLru(Generic[V]):
    """str key -> value, least recently used dropped first while the keys hold more than
    ``max_chars`` characters; a key longer than that is not kept. Safe from several threads."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.num_chars = 0
        self._entries: OrderedDict[Any, tuple[int, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: Any, num_chars: int, value: V) -> None:
        with self._lock:
            if num_chars > self.max_chars or key in self._entries:
                return
            self._entries[key] = (num_chars, value)
            self.num_chars += num_chars
            while self.num_chars > self.max_chars:
                _, (evicted_chars, _) = self._entries.popitem(last=False)
                self.num_chars -= evicted_chars

    def keys(self) -> list[Any]:
        with self._lock:
            return list(self._entries)


class PromptBuilder:
    """The family's chat template and tokenizer with their results cached; built once per API process
    beside the family, called from the event loop (``tokenize`` also from a thread, for long prompts)."""

    def __init__(self, family: FamilyProcessor, max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> None:
        self.family = family
        self._media_ids = {family.image_token_id: "image"}
        if family.video_token_id is not None:
            self._media_ids[family.video_token_id] = "video"
        bos = family.tokenizer.bos_token
        self._bos: str | None = bos if isinstance(bos, str) else None
        # Only an added token is split out of the text before tokenization (see the module docstring).
        added = family.tokenizer.get_added_vocab()
        self._fast_tokenize = all(family.placeholder_token(m) in added for m in self._media_ids.values())
        # every template render_prompt may use: the given one or the processor's, and the one with tools
        plain = family.chat_template_override or family.hf_processor.chat_template
        templates = (plain, family.tool_chat_template)
        self._cache_renders = not any("strftime" in str(template) for template in templates)
        self._prompts: _CharBoundedLru[str] = _CharBoundedLru(max_cached_chars)
        # prompt -> (its ids with one id per media item, the index of each item's id in them)
        self._short_ids: _CharBoundedLru[tuple[tuple[int, ...], tuple[int, ...]]] = _CharBoundedLru(
            max_cached_chars
        )
        self._piece_ids: dict[str, list[int]] = {}  # a piece's text -> its ids (timestamps repeat)

    def render(self, messages: list[dict[str, Any]], template: TemplateOptions = DEFAULT_TEMPLATE) -> str:
        """``family.render_prompt(messages, template)``: the chat template with one media token per
        item."""
        if not self._cache_renders:
            return self.family.render_prompt(messages, template)
        key, num_chars = messages_key(messages)
        prompt = self._prompts.get((key, template))
        if prompt is None:
            prompt = self.family.render_prompt(messages, template)
            self._prompts.put((key, template), num_chars, prompt)
        return prompt

    def tokenize(self, prompt: str, layouts: list[ItemLayout]) -> Tokenized:
        """What ``family.tokenize(prompt, layouts)`` returns (ids, each item's span) or raises.
        ``prompt`` is rendered by the family's chat template."""
        short = self._short(prompt) if self._fast_tokenize else None
        modalities = [layout.modality for layout in layouts if layout.num_tokens > 0]
        if short is None or [self._media_ids[short[0][i]] for i in short[1]] != modalities:
            return self.family.tokenize(prompt, layouts)
        short_ids, media_indices = short
        token_ids: list[int] = []
        spans: list[tuple[int, int]] = []
        start = 0
        for index, layout in zip(media_indices, layouts, strict=True):
            token_ids += short_ids[start:index]
            first = len(token_ids)
            pad = self.family.placeholder_token_id(layout.modality)
            for text, num_pads in self.family.placeholder_pieces(layout):
                token_ids += self._ids_of_piece(text)
                token_ids += [pad] * num_pads
            spans.append((first, len(token_ids)))
            start = index + 1
        token_ids += short_ids[start:]
        return Tokenized(token_ids, spans)

    def _ids_of_piece(self, text: str) -> list[int]:
        ids = self._piece_ids.get(text)
        if ids is None:
            ids = self.family.piece_token_ids(text)
            if len(self._piece_ids) < MAX_CACHED_PIECES:
                self._piece_ids[text] = ids
        return ids

    def _short(self, prompt: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The prompt's ids, one per media token, and the index of each media token's id; None where
        the family's own method must answer."""
        short = self._short_ids.get(prompt)
        if short is not None:
            return short
        # The family decides on a BOS by the expanded text's start, which the prompt's start decides
        # too when the text before the first media token is at least as long as the BOS.
        media = self.family.media_tokens_in(prompt)
        bos = self._bos
        if bos is not None and media and media[0][1] < len(bos):
            return None
        add_special_tokens = not (bos is not None and prompt.startswith(bos))
        ids: list[int] = self.family.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        indices = tuple(i for i, token_id in enumerate(ids) if token_id in self._media_ids)
        if len(indices) != len(media):
            return None  # media ids the text does not spell as media tokens, or the reverse
        short = (tuple(ids), indices)
        self._short_ids.put(prompt, len(prompt), short)
        return short


def messages_key(messages: list[dict[str, Any]]) -> tuple[MessagesKey, int]:
    """A hashable copy of chat-template messages (``app.inputs.input_processor.normalise_messages``'s shape:
    string content, or text and image parts) and its number of characters."""
    key: list[tuple[str, str | tuple[tuple[str, str], ...]]] = []
    num_chars = 0
    for message in messages:
        role, content = message["role"], message["content"]
        if "tool_calls" in message or "tool_call_id" in message:  # their calls and call ids render too
            extra = json.dumps([message.get("tool_calls"), message.get("tool_call_id")], sort_keys=True)
            role = f"{role}\0{extra}"
        num_chars += len(role)
        if isinstance(content, str):
            key.append((role, content))
            num_chars += len(content)
            continue
        parts = tuple((part["type"], part.get("text", "")) for part in content)
        num_chars += sum(len(text) + 1 for _, text in parts)
        key.append((role, parts))
    return tuple(key), num_chars
