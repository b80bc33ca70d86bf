"""The oracle of constrained answers: transformers' ``generate`` with xgrammar's own HF logits processor
(``xgrammar.contrib.hf.LogitsProcessor``) on a grammar the test compiles itself, from the request's
fields, as docs/api.md documents them; and the request that asks the server the same."""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr
from transformers import GenerationConfig, LogitsProcessorList

from engine.structured.backend import JSON_MAX_WHITESPACE, TOOL_CALL_MAX_WHITESPACE
from tests.e2e.conftest import Oracle
from tests.e2e.parity import NEAR_TIE
from tests.near_tie import accept_near_tie


def eos_ids(oracle: Oracle) -> list[int]:
    """The model's end-of-sequence ids: the tokenizer's and the generation config's."""
    configured = oracle.model.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    return list(
        dict.fromkeys(int(t) for t in [oracle.processor.tokenizer.eos_token_id, *configured] if t is not None)
    )


def compile_grammar(oracle: Oracle, structured_outputs: dict[str, Any]) -> Any:
    """The grammar of a request's ``structured_outputs`` (one kind), over the model's whole vocabulary,
    ended by its EOS ids: a JSON schema with whitespace bounded to JSON_MAX_WHITESPACE characters per gap
    (none with ``disable_any_whitespace``), a regex, a choice (as an EBNF of its literals)."""
    vocab_size = oracle.model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(
        oracle.processor.tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids(oracle)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    if "json" in structured_outputs:
        any_whitespace = not structured_outputs.get("disable_any_whitespace", False)
        return compiler.compile_json_schema(
            json.dumps(structured_outputs["json"]),
            any_whitespace=any_whitespace,
            max_whitespace_cnt=JSON_MAX_WHITESPACE if any_whitespace else None,
        )
    if "regex" in structured_outputs:
        return compiler.compile_regex(structured_outputs["regex"])
    raise AssertionError(f"no oracle grammar for {sorted(structured_outputs)}")


def constrained_greedy(
    oracle: Oracle, inputs: Any, grammar: Any, max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy ``generate`` under ``grammar`` until EOS or ``max_new_tokens``: token ids (EOS included if
    sampled) and each step's log-probabilities after the grammar's mask."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids(oracle),
        pad_token_id=oracle.processor.tokenizer.pad_token_id,
    )
    processors = LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(grammar)])
    with torch.inference_mode():
        out = oracle.model.generate(
            **inputs,
            generation_config=config,
            logits_processor=processors,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)


def served_tokens_are_the_oracles(
    response: dict[str, Any], oracle: Oracle, hf_ids: list[int], hf_logprobs: torch.Tensor
) -> bool:
    """The served tokens are the oracle's (its EOS left out: the server ends without it), token for
    token, but for a true near-tie (tests/near_tie.py): False where one was accepted, and nothing after
    it can be compared."""
    tokenizer = oracle.processor.tokenizer
    served = [entry["token"] for entry in response["choices"][0]["logprobs"]["content"]]
    expected = _without_eos(oracle, hf_ids)

    def spell(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    wanted = [spell(token_id) for token_id in expected]
    pos = next((i for i, (a, b) in enumerate(zip(served, wanted, strict=False)) if a != b), None)
    if pos is not None:
        accept_near_tie(pos, served[pos], expected[pos], hf_logprobs[pos], NEAR_TIE, spell)
        return False
    assert served == wanted, f"served {len(served)} tokens, the oracle {len(wanted)}"
    return True


def _without_eos(oracle: Oracle, hf_ids: list[int]) -> list[int]:
    ended = bool(hf_ids) and hf_ids[-1] in eos_ids(oracle)
    return hf_ids[:-1] if ended else hf_ids


def assert_matches_constrained(
    response: dict[str, Any], oracle: Oracle, hf_ids: list[int], hf_logprobs: torch.Tensor
) -> None:
    """The served answer is the oracle's (``served_tokens_are_the_oracles``). Where the oracle sampled
    EOS the server ended with ``stop`` (the grammar allowed nothing else); where it ran out of tokens,
    so did the server (``length``)."""
    if not served_tokens_are_the_oracles(response, oracle, hf_ids, hf_logprobs):
        return
    choice = response["choices"][0]
    expected = _without_eos(oracle, hf_ids)
    assert choice["finish_reason"] == ("stop" if expected != hf_ids else "length")
    assert choice["message"]["content"] == oracle.processor.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    assert response["usage"]["completion_tokens"] == len(expected)


def tool_calls_tag(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> Any:
    """xgrammar's own structural tag for calls in the Hermes format the Qwen families write, as the
    server asks for it (engine/structured/backend.py): the oracle's side of a tool constraint."""
    return xgr.get_model_structural_tag(
        "qwen_3",
        tools=tools,
        tool_choice=tool_choice,
        reasoning="disabled",
        max_whitespace_cnt=TOOL_CALL_MAX_WHITESPACE,
        parallel_tool_calls=parallel,
    )
