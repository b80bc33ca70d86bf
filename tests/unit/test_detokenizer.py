"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained here on multi-byte text."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import LOGPROB_FLOOR, logprob_entries
from wire.protocol import Logprob, TokenLogprobs

# Mostly ASCII, so that the few merges of multi-byte text give tokens that split characters, and some
# that straddle two ("¥æ": the end of 日 and the start of 本).
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog. plain ascii text"] * 20 + [
    "héllo wörld 日本語 🙂",
    "déjà vu 🚀 — 日本語のテキスト ✓ brûlée",
    "🙂🙂🙂 emoji-only run 🙂",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


TEXTS = [
    "héllo wörld 日本語 🙂",
    "déjà vu 🚀 — 日本語のテキスト ✓ brûlée",
    "🙂🙂🙂 emoji-only run 🙂",
    "plain ascii text",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    if not detok.stopped:
        deltas.append(detok.flush())
    return deltas


def test_corpus_really_splits_characters_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = [bytes(IncrementalDetokenizer(tokenizer).token_bytes(i)) for i in ids]
    assert any(p[0] & 0xC0 == 0x80 and p[-1] >= 0xC0 for p in pieces)  # ends one character, starts the next


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tokenizer: PreTrainedTokenizerFast, text: str, chunk: int) -> None:
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = _stream(detok, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert detok.text == text


def test_special_tokens_kept_when_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [*tokenizer.encode("héllo", add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == "héllo</s>"


def test_random_token_streams_match_full_decode(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for _ in range(50):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        deltas = _stream(detok, ids, chunk=rng.randrange(1, 4))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        # Only what the model really produced may contain U+FFFD, and then only once it is settled.
        assert all(not d.endswith("\ufffd") for d in deltas[:-1] if d) or "\ufffd" in tokenizer.decode(ids)


def test_incomplete_character_waits_and_flush_releases_it(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])  # the request ended: U+FFFD as in a full decode
    assert detok.push(ids[1:]) == ""  # finished: nothing more


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("héllo wörld 日本語 🙂", ["wörld"], "héllo "),
        ("héllo wörld 日本語 🙂", ["本", "wö"], "héllo "),  # the earliest match wins
        ("héllo wörld 日本語 🙂", ["🙂"], "héllo wörld 日本語 "),
        ("plain ascii text", ["ascii text"], "plain "),
        ("déjà vu 🚀 — 日本語のテキスト ✓ brûlée", ["のテ"], "déjà vu 🚀 — 日本語"),
    ],
)
def test_stop_string_truncates_and_is_never_streamed(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: list[str], expected: str, chunk: int
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    streamed = ""
    for i in range(0, len(ids), chunk):
        streamed += detok.push(ids[i : i + chunk])
        for s in stop:  # not even a prefix of a stop string may have gone out past the expected text
            assert not streamed.startswith(expected + s[:1])
        if detok.stopped:
            break
    assert detok.stopped
    assert detok.stop_str in stop
    assert streamed == detok.text == expected
    assert detok.push(ids) == "" and detok.flush() == ""


def test_include_stop_str(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("héllo wörld 日本語", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["wörld"], include_stop_str=True)
    assert "".join(_stream(detok, ids)) == "héllo wörld"
    assert detok.stopped and detok.stop_str == "wörld"


def test_held_back_prefix_is_released_when_it_diverges(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["hello world!"])
    ids = tokenizer.encode("hello world, the", add_special_tokens=False)
    streamed = ""
    for k, token_id in enumerate(ids):
        streamed += detok.push([token_id])
        if "hello world!".startswith(str(tokenizer.decode(ids[: k + 1]))):
            assert streamed == ""  # could still become the stop string
    assert streamed == "hello world, t"  # the "he" of "the" could start it again
    assert not detok.stopped
    assert detok.flush() == "he"


def test_flush_releases_stop_prefix_at_the_end(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["日本語!"])
    ids = tokenizer.encode("wörld 日本語", add_special_tokens=False)
    streamed = "".join(detok.push([i]) for i in ids)
    assert streamed == "wörld "
    assert detok.flush() == "日本語"
    assert detok.text == "wörld 日本語"
    assert not detok.stopped


def test_token_strings_and_bytes(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "héllo 日本語 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert b"".join(bytes(detok.token_bytes(i)) for i in ids) == text.encode("utf-8")
    strings = detok.token_strings(ids)
    assert len(strings) == len(ids)
    for token_id, string in zip(ids, strings, strict=True):
        raw = bytes(detok.token_bytes(token_id))
        if string.startswith("bytes:"):
            assert string == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert string.encode("utf-8") == raw
    assert any(s.startswith("bytes:") for s in strings)
    assert detok.token_strings([tokenizer.eos_token_id]) == ["</s>"]


def test_ids_after_a_stop_string_are_not_taken(tokenizer: PreTrainedTokenizerFast) -> None:
    """Several ids in one push end where single ids would: at the one that completes the stop string."""
    ids = tokenizer.encode("héllo wörld 日本語 🙂", add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tokenizer, stop=["wör"])
    text = "".join(_stream(one_by_one, ids))
    assert one_by_one.stopped and len(one_by_one.token_ids) < len(ids)
    for chunk in (2, 5, len(ids)):
        batched = IncrementalDetokenizer(tokenizer, stop=["wör"])
        assert "".join(_stream(batched, ids, chunk)) == text == "héllo "
        assert batched.token_ids == one_by_one.token_ids


def test_random_batches_with_stop_strings_end_as_one_by_one(tokenizer: PreTrainedTokenizerFast) -> None:
    """Seeded differential: random texts, stop strings taken from them (or absent), random batch sizes:
    the released text, the ids taken and the stop found are those of one id at a time."""
    rng = random.Random(1)
    texts = [*TEXTS, *CORPUS[-3:]]
    for _ in range(200):
        text = rng.choice(texts)
        ids = tokenizer.encode(text, add_special_tokens=False)
        start = rng.randrange(len(text))
        stops = [text[start : start + rng.randrange(1, 4)], "never there"][: rng.randrange(1, 3)]
        include = rng.random() < 0.3
        one = IncrementalDetokenizer(tokenizer, stop=stops, include_stop_str=include)
        expected = "".join(_stream(one, ids))
        batched = IncrementalDetokenizer(tokenizer, stop=stops, include_stop_str=include)
        pushes, i = [], 0
        while i < len(ids):
            size = rng.randrange(1, 8)
            pushes.append(batched.push(ids[i : i + size]))
            i += size
        if not batched.stopped:
            pushes.append(batched.flush())
        assert ("".join(pushes), batched.token_ids, batched.stop_str) == (
            expected,
            one.token_ids,
            one.stop_str,
        )


def test_the_stop_token_that_ended_the_answer_counts_but_is_no_text(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """vLLM's semantics for an answer a stop token ended (EOS or ``stop_token_ids``): the token is among
    the output's ids, its text is not, unless ``include_stop_str`` (``include_stop_str_in_output``)."""
    ids = tokenizer.encode("hello world the fox")
    for pushed in (len(ids) - 2, 0):  # the stop token alone with one more, or every id in the last output
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.push([token_id]) for token_id in ids[:pushed])
        text += detok.push_ending_on_stop_token(ids[pushed:])
        assert text == detok.text == tokenizer.decode(ids[:-1]) and detok.token_ids == ids
        assert detok.push([ids[-1]]) == "" and detok.flush() == ""  # finished
    kept = IncrementalDetokenizer(tokenizer, include_stop_str=True)
    assert kept.push_ending_on_stop_token(ids) == tokenizer.decode(ids)
    # a stop string before the stop token ends the text there, as on its own
    stopped = IncrementalDetokenizer(tokenizer, stop=["world"])
    assert stopped.push_ending_on_stop_token(ids) == "hello " and stopped.stop_str == "world"


def test_logprobs_json_cannot_carry_are_sent_as_the_floor(tokenizer: PreTrainedTokenizerFast) -> None:
    """A model that overflowed gives NaN or -inf logprobs: JSON has neither (a 500 for an unstreamed
    answer, an unparsable chunk for a streamed one), so they go out as vLLM's floor."""
    entries = [
        TokenLogprobs(Logprob(5, float("nan")), [Logprob(5, float("nan")), Logprob(6, float("-inf"))]),
        TokenLogprobs(Logprob(7, -0.25), [Logprob(7, -0.25)]),
    ]
    items = logprob_entries(entries, IncrementalDetokenizer(tokenizer))
    json.dumps(items, allow_nan=False)
    assert [item["logprob"] for item in items] == [LOGPROB_FLOOR, -0.25]
    assert [top["logprob"] for top in items[0]["top_logprobs"]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_min_tokens_counts_only_stop_strings_ending_past_them(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("héllo wörld héllo wörld", add_special_tokens=False)
    prefix_ids = next(k for k in range(1, len(ids)) if "wörld" in tokenizer.decode(ids[:k]))
    for chunk in (1, 3, len(ids)):
        detok = IncrementalDetokenizer(tokenizer, stop=["wörld"], min_tokens=prefix_ids)
        streamed = "".join(_stream(detok, ids, chunk))
        assert detok.stopped and detok.stop_str == "wörld"
        assert streamed == detok.text == "héllo wörld héllo ", chunk  # the second: the first ended too early
        unheld = IncrementalDetokenizer(tokenizer, stop=["wörld"])
        assert "".join(_stream(unheld, ids, chunk)) == "héllo "
    # a stop string that starts within the first tokens and ends past them counts
    k = next(k for k in range(2, len(ids)) if "\ufffd" not in tokenizer.decode(ids[:k]))
    detok = IncrementalDetokenizer(tokenizer, stop=[tokenizer.decode(ids[:k])], min_tokens=k - 1)
    assert "".join(_stream(detok, ids)) == "" and detok.stopped


def test_min_tokens_ignores_a_whole_stop_string_held_for_a_longer_one(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """A stop string whole within the first tokens is text even where another stop string starts with
    it, or is longer: it did not end past them (held back, it used to match with the next token)."""
    ids = tokenizer.encode("hello world, the quick brown fox", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) == "hello"  # ("hello" once: no stop string below ends past it)
    for stop in (["hello", "zz"], ["hello", "hello!"], ["hell", "hello!"]):
        detok = IncrementalDetokenizer(tokenizer, stop=stop, min_tokens=1)
        assert "".join(_stream(detok, ids)) == tokenizer.decode(ids), stop
        assert not detok.stopped


ASCII = "hello world, the quick brown fox jumps over the lazy dog"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), min_tokens=st.integers(0, 12), chunk=st.sampled_from([1, 2, 5]))
def test_a_stop_string_ends_the_text_where_it_first_ends_past_min_tokens(
    tokenizer: PreTrainedTokenizerFast, data: st.DataObject, min_tokens: int, chunk: int
) -> None:
    """Against the rule itself, token by token: the first token past ``min_tokens`` whose text completes
    a stop string that ends past the first ``min_tokens`` tokens' text ends the answer, before the
    earliest such string (the longest where two start together)."""
    ids = tokenizer.encode(ASCII, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]  # ASCII: whole characters
    spans = st.tuples(st.integers(0, len(ASCII) - 1), st.integers(1, 4))
    stop = sorted({ASCII[a : a + n] for a, n in data.draw(st.lists(spans, min_size=1, max_size=3))})
    expected, floor = texts[-1], len(texts[min(min_tokens, len(ids))])
    for k in range(min_tokens + 1, len(ids) + 1):
        found = [
            (pos, -len(s), s)
            for s in stop
            for pos in range(len(texts[k]))
            if texts[k].startswith(s, pos) and pos + len(s) > floor
        ]
        if found:
            expected = texts[k][: min(found)[0]]
            break
    detok = IncrementalDetokenizer(tokenizer, stop=stop, min_tokens=min_tokens)
    assert "".join(_stream(detok, ids, chunk)) == expected == detok.text, (stop, min_tokens)
