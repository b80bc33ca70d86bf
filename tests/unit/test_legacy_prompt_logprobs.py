"""An echoed prompt's legacy logprobs (app/api/completion_responses.py ``prompt_logprobs``) say what chat's
logprob entries of the same tokens say (app/api/outputs.py ``logprob_entries``: each token's text, a
partial character as ``bytes:...``, -inf and NaN as vLLM's floor), in the legacy shape: the first token's
null, ``top_logprobs`` the token and its first ``num_top`` alternatives by text, and ``text_offset``
where each token's text begins in the prompt as its ids decode (a SentencePiece-style tokenizer whose
decoder strips the text's first space, with byte fallback)."""

from __future__ import annotations

import math
import random

from app.api.completion_responses import prompt_logprobs
from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import LOGPROB_FLOOR, logprob_entries
from tests.sentencepiece_style import sentencepiece_tokenizer
from wire.protocol import Logprob, PromptLogprobs, TokenLogprobs

WORDS = ["▁The", "▁cat", "▁sat", "▁on", "▁a", "▁mat", ".", "▁", "a", "b"]


def test_the_legacy_shape_says_what_chats_entries_say() -> None:
    tok = sentencepiece_tokenizer(WORDS)
    text = "The cat sat on a mat. 猫"  # (the last character in three byte-fallback tokens)
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]
    rng = random.Random(0)
    entries = []
    for t in ids[1:]:
        alternatives = [Logprob(rng.randrange(len(tok)), -rng.random() * 5) for _ in range(4)]
        entries.append(TokenLogprobs(Logprob(t, -rng.random() * 9), alternatives))
    entries[2] = TokenLogprobs(Logprob(ids[3], -math.inf), entries[2].top)
    run = PromptLogprobs(
        1,
        4,
        [e.sampled.logprob for e in entries],
        [1] * len(entries),
        [alt.token_id for e in entries for alt in e.top],
        [alt.logprob for e in entries for alt in e.top],
    )
    echoed = tok.decode(ids, skip_special_tokens=True)
    assert echoed == text

    got = prompt_logprobs(ids, run, IncrementalDetokenizer(tok), echoed, 2)

    detok = IncrementalDetokenizer(tok)
    chat = logprob_entries([TokenLogprobs(e.sampled, e.top[:2]) for e in entries], detok)
    assert got["tokens"] == [detok.token_strings([ids[0]])[0], *(item["token"] for item in chat)]
    assert got["token_logprobs"] == [None, *(item["logprob"] for item in chat)]
    assert got["token_logprobs"][3] == LOGPROB_FLOOR
    assert got["top_logprobs"] == [
        None,
        *(
            {item["token"]: item["logprob"]} | {a["token"]: a["logprob"] for a in item["top_logprobs"]}
            for item in chat
        ),
    ]
    assert any(
        token.startswith("bytes:") for token in got["tokens"]
    )  # a partial character, as chat spells it
    offsets = got["text_offset"]
    assert offsets[:3] == [0, 0, 3]  # "<s>" (skipped), "The", " cat"
    assert offsets[-3:] == [len(text) - 1] * 3  # the three bytes of the last character: where it begins
    for token, start in zip(got["tokens"][1:-3], offsets[1:-3], strict=True):
        assert text[start:].startswith(token.lstrip(" ") if start == 0 else token)
