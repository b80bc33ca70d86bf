"""The helpers every parity and cache test stands on refuse what they must: a served token that is not the
oracle's runner-up (tests/near_tie.py, both tiers' assertions), and a metric the server does not export
(tests/e2e/metrics.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from app.metrics import ApiMetrics
from tests.e2e.metrics import UnknownMetric, delta, parse_metrics
from tests.e2e.parity import NEAR_TIE, assert_matches_greedy
from tests.near_tie import NearTieWarning, accept_near_tie, logit_step

WORDS = ["alpha", "beta", "gamma", "delta", "[UNK]"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")))


def logprobs_row(*values: float) -> torch.Tensor:
    """A position's logprobs over WORDS (the last, [UNK], far below)."""
    return torch.tensor([*values, -50.0])


def response(words: list[str]) -> dict[str, Any]:
    """A chat completion as the API returns it with ``logprobs``, for the served tokens ``words``."""
    return {
        "choices": [
            {
                "message": {"content": " ".join(words)},
                "logprobs": {"content": [{"token": word} for word in words]},
            }
        ],
        "usage": {"completion_tokens": len(words)},
    }


# The oracle picks alpha, beta, alpha; at position 1 beta leads gamma by 2e-4 and delta by 5e-4.
ORACLE_IDS = [0, 1, 0]
ORACLE_LOGPROBS = torch.stack(
    [
        logprobs_row(-0.1, -3.0, -4.0, -5.0),
        logprobs_row(-2.0, -1.0, -1.0002, -1.0005),
        logprobs_row(-0.2, -2.0, -3.0, -4.0),
    ]
)


def test_the_same_tokens_pass_without_a_near_tie(tokenizer: PreTrainedTokenizerFast) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NearTieWarning)
        assert_matches_greedy(response(["alpha", "beta", "alpha"]), tokenizer, ORACLE_IDS, ORACLE_LOGPROBS)


def test_the_runner_up_at_a_near_tie_passes_and_is_reported(tokenizer: PreTrainedTokenizerFast) -> None:
    """Nothing after the near-tie is compared: the answers continue different prefixes."""
    with pytest.warns(NearTieWarning, match=r"token 1: .*'gamma' instead of 'beta', logprob gap 2\.0"):
        assert_matches_greedy(response(["alpha", "gamma", "delta"]), tokenizer, ORACLE_IDS, ORACLE_LOGPROBS)


def test_a_token_that_is_not_the_runner_up_fails_however_close(tokenizer: PreTrainedTokenizerFast) -> None:
    """delta is within the bound of the oracle's token, but gamma is the runner-up: the old rule (top-2
    gap only) let any token through here."""
    assert ORACLE_LOGPROBS[1, 1] - ORACLE_LOGPROBS[1, 3] < NEAR_TIE
    with pytest.raises(AssertionError, match="only the runner-up may differ"):
        assert_matches_greedy(response(["alpha", "delta", "alpha"]), tokenizer, ORACLE_IDS, ORACLE_LOGPROBS)


def test_the_runner_up_beyond_the_bound_fails(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_matches_greedy(response(["beta", "beta", "alpha"]), tokenizer, ORACLE_IDS, ORACLE_LOGPROBS)


def test_a_different_length_fails(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(AssertionError):
        assert_matches_greedy(response(["alpha", "beta"]), tokenizer, ORACLE_IDS, ORACLE_LOGPROBS)


def test_the_rule_on_token_ids() -> None:
    """The integration tier's form (token ids); exact ties for runner-up accept either."""
    tied = logprobs_row(-1.0, -1.00001, -1.00001, -3.0)
    with pytest.warns(NearTieWarning, match="token 4"):
        assert accept_near_tie(4, 2, 0, tied, 1e-4) == pytest.approx(1e-5, rel=1e-2)
    with pytest.raises(AssertionError, match="only the runner-up"):
        accept_near_tie(4, 3, 0, tied, 1e-4)
    with pytest.raises(AssertionError, match="not a near-tie"):
        accept_near_tie(4, 1, 0, logprobs_row(-1.0, -1.01, -2.0, -3.0), 1e-4)


def bf16_logprobs(*logits: float) -> torch.Tensor:
    """The oracle's logprobs as the CUDA tier computes them: from bf16 logits, in float32."""
    return torch.log_softmax(torch.tensor([*logits, 5.0], dtype=torch.bfloat16).float(), dim=-1)


def test_bf16_ties_are_ties_at_the_logits_rounding_step() -> None:
    """bf16 logits near 20 come in steps of 0.125. With the oracle's best two tied, a token one step below
    them may lead another bf16 computation of the same logits (the CUDA tier's only rank-3 divergence):
    it passes there, and only there."""
    tied_top = bf16_logprobs(20.0, 20.0, 19.875, 19.75)
    assert logit_step(tied_top) == pytest.approx(0.125, abs=1e-5)
    with pytest.warns(NearTieWarning, match=r"token 3: .* 0\.125 below its runner-up .* gap 1\.25e-01"):
        assert accept_near_tie(3, 2, 0, tied_top, 0.25, quantized=True) == pytest.approx(0.125, abs=1e-5)
    with pytest.raises(AssertionError, match="only the runner-up may differ"):
        accept_near_tie(3, 2, 0, tied_top, 0.25)  # not bf16: a step is no tie
    with pytest.raises(AssertionError, match="only the runner-up or a token within"):
        accept_near_tie(3, 3, 0, tied_top, 0.25, quantized=True)  # two steps below the runner-up
    with pytest.raises(
        AssertionError, match="only the runner-up"
    ):  # one step below a runner-up one step down
        accept_near_tie(3, 2, 0, bf16_logprobs(20.0, 19.875, 19.75, 19.0), 0.25, quantized=True)
    # at a finer step (logits near 10: 0.0625) the third token would be within the bound: still refused
    with pytest.raises(AssertionError, match="only the runner-up"):
        accept_near_tie(3, 2, 0, bf16_logprobs(10.0, 9.875, 9.8125, 5.0), 0.25, quantized=True)
    with pytest.warns(NearTieWarning, match="served the oracle's runner-up 1 instead of 0"):
        accept_near_tie(3, 1, 0, tied_top, 0.25, quantized=True)


def test_a_metric_the_server_does_not_export_raises() -> None:
    """The API's real exposition: a misspelt or dropped name is an error, never 0."""
    reading = parse_metrics(ApiMetrics().render().decode())
    assert reading["mmserve_encoder_runs_total"] == 0
    assert reading["mmserve_mm_processor_seconds_count"] == 0
    assert delta(reading, reading, "mmserve_mm_ipc_cache_hits_total") == 0
    for name in ("mmserve_encoder_run_total", "mmserve_encoder_runs", "mmserve_mm_processor_seconds_cnt"):
        with pytest.raises(UnknownMetric, match=name):
            delta(reading, reading, name)
        with pytest.raises(UnknownMetric):
            reading.get(name, 0.0)  # no default hides it either


def test_a_labelled_sample_reads_zero_only_in_a_declared_family() -> None:
    """Prometheus shows a label set from its first increment on; its family is declared from the start."""
    text = (
        "# HELP mmserve_widgets_total Widgets.\n# TYPE mmserve_widgets counter\n"
        'mmserve_widgets_total{kind="a"} 3.0\n'
    )
    reading = parse_metrics(text)
    assert reading['mmserve_widgets_total{kind="a"}'] == 3
    assert reading['mmserve_widgets_total{kind="b"}'] == 0
    with pytest.raises(UnknownMetric):
        reading['mmserve_gadgets_total{kind="a"}']
    with pytest.raises(UnknownMetric):
        reading["mmserve_widgets_count"]  # not a sample of a counter, and unlabelled
