"""How logprobs spell a token: its raw bytes (a byte-level BPE token's, a SentencePiece piece's with its
word mark as a space, a byte-fallback piece's one byte) and its text, ``bytes:\\xe6\\x97`` where the
token is only part of a character, as OpenAI writes it. Each depends on the tokenizer and the token
alone, so it is worked out once per token id and kept for the process, shared by every request (a
vocabulary's worth at most): a scored prompt of 500 tokens then looks up 500 entries, not 500
tokenizer calls."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any
from weakref import WeakKeyDictionary

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for raw bytes (``Ġ`` for a space), reversed: character → byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenSpelling:
    """One tokenizer's tokens as logprobs spell them, each worked out on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        self._added = frozenset(getattr(tokenizer, "added_tokens_decoder", {}))  # (a dict built per call)
        self._bytes: dict[int, list[int]] = {}
        self._strings: dict[int, str] = {}

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes a single token stands for (may be part of a UTF-8 character)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._raw_bytes(token_id)
        return cached

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's text for logprobs. A token that is only part of a character is written as
        OpenAI does, ``bytes:\\xe6\\x97`` (its ``bytes`` field carries the real values)."""
        strings = []
        for token_id in token_ids:
            spelt = self._strings.get(token_id)
            if spelt is None:
                raw = bytes(self.token_bytes(token_id))
                try:
                    spelt = raw.decode("utf-8")
                except UnicodeDecodeError:
                    spelt = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
                self._strings[token_id] = spelt
            strings.append(spelt)
        return strings

    def _raw_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._added:
            if (match := _BYTE_FALLBACK.match(piece)) is not None:  # sentencepiece byte fallback: <0xE6>
                return [int(match.group(1), 16)]
            if not self._byte_level and "\u2581" in piece:  # sentencepiece's word mark "▁" is a space
                return list(piece.replace("\u2581", " ").encode("utf-8"))
            alphabet = _byte_level_alphabet()
            if self._byte_level and all(char in alphabet for char in piece):
                return [alphabet[char] for char in piece]
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))


_spellings: WeakKeyDictionary[Any, TokenSpelling] = WeakKeyDictionary()


def spelling_of(tokenizer: Any) -> TokenSpelling:
    """The process's ``TokenSpelling`` of ``tokenizer`` (made on first use, gone with the tokenizer)."""
    spelling = _spellings.get(tokenizer)
    if spelling is None:
        spelling = _spellings[tokenizer] = TokenSpelling(tokenizer)
    return spelling
