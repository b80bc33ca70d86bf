"""IncrementalDetokenizer after a prompt's last ids (``context``), against a SentencePiece-style tokenizer
built here as LLaVA-1.5's Llama tokenizer is (a word mark ``▁``, byte fallback, and a decoder that strips
the text's first space): a continuation keeps the space its first token carries, so prompt + answer is
the decode of their ids, streamed or not; a context that ends in half a character is not used."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from app.api.detokenizer import IncrementalDetokenizer
from tests.sentencepiece_style import sentencepiece_tokenizer

WORDS = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁", "a", "b"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return sentencepiece_tokenizer(WORDS)


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def streamed(detok: IncrementalDetokenizer, token_ids: list[int]) -> str:
    return "".join(detok.push([token_id]) for token_id in token_ids) + detok.flush()


def test_a_continuation_keeps_the_space_of_its_first_token(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = ids(tokenizer, "The capital of France is")
    answer = [tokenizer.convert_tokens_to_ids("▁Paris"), tokenizer.convert_tokens_to_ids(".")]
    assert streamed(IncrementalDetokenizer(tokenizer), answer) == "Paris."  # alone: as a chat answer
    after = IncrementalDetokenizer(tokenizer, context=prompt[-5:])
    assert streamed(after, answer) == " Paris."
    assert tokenizer.decode(prompt) + after.text == tokenizer.decode(prompt + answer)
    whole = IncrementalDetokenizer(tokenizer, context=prompt[-5:])
    assert whole.push(answer) + whole.flush() == " Paris."  # (one push of both)


def test_characters_of_several_tokens_still_wait_and_a_split_context_is_dropped(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    prompt = ids(tokenizer, "The capital is")
    answer = ids(tokenizer, "你好 a")  # "▁你好▁a", byte fallback: three ids a character
    assert len(answer) > 6
    after = IncrementalDetokenizer(tokenizer, context=prompt)
    pieces = [after.push([token_id]) for token_id in answer]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + after.flush() == " 你好 a"
    half = ids(tokenizer, "a 你")[:-1]  # ends one byte short of 你
    split = IncrementalDetokenizer(tokenizer, context=half)
    assert streamed(split, ids(tokenizer, "b")) == "b"  # "▁b" decoded alone, as without a context
