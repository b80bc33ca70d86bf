"""The oracle of penalised and biased answers: transformers' ``generate`` with a ``LogitsProcessorList`` in
the order workers/sampler.py applies them (``logit_bias``, then ``repetition_penalty``, then
``frequency_penalty`` and ``presence_penalty``), transformers' own processors where it has them; and the
teacher-forced check of a ``min_p`` answer."""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from tests.e2e.conftest import Oracle


class OutputPenaltyLogitsProcessor(LogitsProcessor):
    """OpenAI's frequency and presence penalties, which transformers lacks: ``logits -= frequency x count
    + presence x (count > 0)``, counting each id in the generated tokens only, never in the prompt."""

    def __init__(self, frequency: float, presence: float, num_prompt_tokens: int) -> None:
        self.frequency = frequency
        self.presence = presence
        self.num_prompt_tokens = num_prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.num_prompt_tokens :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def sampler_processors(params: dict[str, Any], num_prompt_tokens: int) -> LogitsProcessorList:
    """The processors of a request's ``params`` (its penalty and bias fields, as the API takes them), in
    the sampler's order; a field left out is off."""
    processors = LogitsProcessorList()
    if params.get("logit_bias"):
        bias: list[list[list[int] | float]] = [
            [[int(token_id)], float(value)] for token_id, value in params["logit_bias"].items()
        ]
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=bias))
    if params.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=float(params["repetition_penalty"])))
    frequency, presence = params.get("frequency_penalty", 0.0), params.get("presence_penalty", 0.0)
    if frequency or presence:
        processors.append(OutputPenaltyLogitsProcessor(frequency, presence, num_prompt_tokens))
    return processors


def penalised_greedy(
    oracle: Oracle, inputs: Any, params: dict[str, Any], max_new_tokens: int, *, reverse: bool = False
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` under ``sampler_processors(params)``, EOS never reached (as ``ignore_eos``):
    token ids, each step's log-probabilities of the processed scores its argmax was taken over (what a
    near-tie is judged on) and of the raw logits (what the server reports as logprobs). ``reverse``: the
    processors in the opposite order (to show that a test's order matters)."""
    num_prompt_tokens = inputs["input_ids"].shape[1]
    processors = sampler_processors(params, num_prompt_tokens)
    if reverse:
        processors = LogitsProcessorList(reversed(processors))
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=oracle.processor.tokenizer.pad_token_id,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = oracle.model.generate(**inputs, generation_config=config, logits_processor=processors)
    ids = out.sequences[0, num_prompt_tokens:].tolist()
    assert len(ids) == max_new_tokens, (
        f"the oracle stopped at EOS after {len(ids)} tokens: pick another prompt"
    )
    scores, logits = torch.stack(out.scores)[:, 0].float(), torch.stack(out.logits)[:, 0].float()
    # generate ran our list and nothing else: no processor of its own, none reordered
    for step in range(max_new_tokens):
        prefix = out.sequences[:, : num_prompt_tokens + step]
        assert torch.equal(processors(prefix, logits[step : step + 1].clone())[0], scores[step]), step
    return ids, torch.log_softmax(scores, dim=-1), torch.log_softmax(logits, dim=-1)


def teacher_forced_logits(oracle: Oracle, inputs: Any, token_ids: list[int]) -> torch.Tensor:
    """The model's logits ([len(token_ids), vocab]) at each of ``token_ids``, fed after the prompt of
    ``inputs`` in one forward: row i is what token i was sampled from. The media tensors go in as the
    processor made them (Qwen: with ``image_grid_thw``); per-token ones (Qwen's ``mm_token_type_ids``)
    are extended with text (0) over the answer."""
    num_prompt_tokens = inputs["input_ids"].shape[1]
    answer = torch.tensor([token_ids], dtype=inputs["input_ids"].dtype)
    input_ids = torch.cat([inputs["input_ids"], answer], dim=1)
    media = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in media:
        media["mm_token_type_ids"] = torch.cat([media["mm_token_type_ids"], torch.zeros_like(answer)], dim=1)
    with torch.inference_mode():
        logits = oracle.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **media).logits
    return logits[0, num_prompt_tokens - 1 : -1].float()


def min_p_survivors(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """Which tokens of each row (bool, the shape of ``logits``) transformers' ``MinPLogitsWarper`` keeps
    after its ``TemperatureLogitsWarper``, the sampler's order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)])
    no_ids = cast(torch.LongTensor, torch.zeros((logits.shape[0], 0), dtype=torch.long))  # neither reads them
    return torch.isfinite(warpers(no_ids, logits.clone()))
