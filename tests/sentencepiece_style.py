"""A SentencePiece-style tokenizer built in a test, as LLaVA-1.5's Llama tokenizer is: a word mark ``▁``,
byte fallback for every byte, and a decoder that strips the text's first space."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast


def sentencepiece_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """``<unk>``, ``<s>``, ``</s>``, the 256 byte pieces, then ``words`` (each a piece)."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", -10.0) for byte in range(256)]
    pieces += [(word, -1.0) for word in words]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    unigram.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    unigram.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=unigram, bos_token="<s>", eos_token="</s>")
