"""Structured outputs in the engine (engine/structured/): a constrained request waits for its grammar
without holding a batch slot, samples only what the grammar allows (the stand-in worker takes the first
token its bitmask row allows), follows its tokens through preemption, and ends with ``stop`` when the
grammar is complete; compiles are cached by constraint, shared while running, bounded in bytes and in
time, dropped when nobody waits for them, and never fail more than their request. Real xgrammar over
the tiny LLaVA's tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from engine.config import StructuredOutputOptions
from engine.core import EngineCore
from engine.structured.backend import CompileError
from engine.structured.compiler import GrammarCompiler
from tests.standin_worker import StandinWorker
from tests.unit.engine_core_support import run_until_idle, scheduler_config
from wire.protocol import AddRequest, Constraint, ConstraintKind, FinishReason, RequestOutput, SamplingParams
from workers.families.llava.tiny import _build_tokenizer

VOCAB_SIZE = 2050  # the tiny LLaVA tokenizer's
EOS = 2
MAX_STEPS = 1000
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
    "required": ["x", "tag"],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    _build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


def compiler(tokenizer_dir: Path, *, cache_bytes: int = 1 << 30, timeout_s: float = 60.0) -> GrammarCompiler:
    return GrammarCompiler(
        StructuredOutputOptions(str(tokenizer_dir), cache_bytes, timeout_s), wake=lambda: None
    )


@pytest.fixture
def grammars(tokenizer_dir: Path) -> Iterator[GrammarCompiler]:
    compiled = compiler(tokenizer_dir)
    yield compiled
    compiled.close()


def core_with(grammars: GrammarCompiler, worker: StandinWorker | None = None, **overrides: int) -> EngineCore:
    worker = worker or StandinWorker(vocab_size=VOCAB_SIZE)
    config = scheduler_config(worker.ready, **overrides)
    return EngineCore(config, worker, vocab_size=VOCAB_SIZE, grammars=grammars)


def request(
    req_id: str, constraint: Constraint | None, max_tokens: int = 200, prompt_len: int = 20
) -> AddRequest:
    sampling = SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,))
    return AddRequest(req_id, list(range(3, 3 + prompt_len)), sampling, constraint=constraint)


def schema(value: dict, any_whitespace: bool = True) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(value), any_whitespace)


def wait_for_grammars(core: EngineCore, timeout_s: float = 30.0) -> dict[bytes, list[RequestOutput]]:
    """Polls until no request waits for its grammar; the outputs that produced."""
    outputs: dict[bytes, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout_s
    while core.grammar_tickets:
        assert time.monotonic() < deadline, "a grammar never compiled"
        for client, outs in core.resolve_grammars().items():
            outputs.setdefault(client, []).extend(outs)
        time.sleep(0.005)
    return outputs


def answers(outputs: dict[bytes, list[RequestOutput]]) -> dict[str, tuple[list[int], FinishReason | None]]:
    found: dict[str, tuple[list[int], FinishReason | None]] = {}
    for out in outputs.get(b"a", []):
        tokens, _ = found.get(out.req_id, ([], None))
        found[out.req_id] = ([*tokens, *out.new_token_ids], out.finish_reason)
    return found


def test_a_json_schema_answer_validates_and_ends_with_stop(
    grammars: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    core = core_with(grammars)
    for any_whitespace in (True, False):
        req_id = f"r-{any_whitespace}"
        core.add_request(b"a", request(req_id, schema(POINT, any_whitespace)), [])
        wait_for_grammars(core)
        tokens, reason = answers(run_until_idle(core, MAX_STEPS))[req_id]
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), POINT)
        assert reason is FinishReason.STOP and EOS not in tokens  # ended without sampling EOS
        if not any_whitespace:
            assert "\n" not in text and "  " not in text


def test_every_kind_is_followed(grammars: GrammarCompiler, tokenizer: PreTrainedTokenizerFast) -> None:
    core = core_with(grammars)
    kinds = {
        "regex": Constraint(ConstraintKind.REGEX, r"[a-f]{3}-\d{2}"),
        "choice": Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no", "maybe so"])),
        "grammar": Constraint(ConstraintKind.GRAMMAR, 'root ::= "(" [a-z]{1,5} ")"'),
        "object": Constraint(ConstraintKind.JSON_OBJECT),
    }
    for name, constraint in kinds.items():
        core.add_request(b"a", request(name, constraint, max_tokens=400), [])
    wait_for_grammars(core)
    found = {
        name: tokenizer.decode(tokens)
        for name, (tokens, _) in answers(run_until_idle(core, MAX_STEPS)).items()
    }
    assert len(found["regex"]) == 6 and found["regex"][3] == "-"
    assert found["choice"] in ("yes", "no", "maybe so")
    assert found["grammar"].startswith("(") and found["grammar"].endswith(")")
    assert isinstance(json.loads(found["object"]), dict)


def test_only_requests_that_sample_get_a_bitmask_row(grammars: GrammarCompiler) -> None:
    """A prefill chunk that does not reach the prompt's end samples nothing and gets no row; every token
    the constrained request samples had one, and the tokens its grammar forced (the only one allowed)
    were appended without a sample; an unconstrained request beside it samples what it samples alone,
    without a row."""
    worker = StandinWorker(vocab_size=VOCAB_SIZE)
    core = core_with(grammars, worker, max_num_batched_tokens=64)
    core.add_request(b"a", request("c", schema(POINT), prompt_len=150), [])
    core.add_request(b"a", request("free", None, max_tokens=5, prompt_len=30), [])
    wait_for_grammars(core)
    found = answers(run_until_idle(core, MAX_STEPS))
    assert found["free"] == ([33, 34, 35, 36, 37], FinishReason.LENGTH)
    rows = [step.sched.grammar_bitmask.req_ids if step.sched.grammar_bitmask else [] for step in worker.steps]
    assert rows[0] == [] and worker.steps[0].sched.num_scheduled_tokens["c"] == 64  # no sample yet
    assert all(row in ([], ["c"]) for row in rows)
    forced = core.scheduler.num_forced_tokens
    assert forced > 0  # '{"x": ' and the like
    assert sum(row == ["c"] for row in rows) == len(found["c"][0]) - forced


def test_scheduling_ahead_waits_while_a_constrained_request_samples(
    grammars: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """``--async-scheduling``: a step is not sent ahead while a constrained request samples in the step
    in flight (its grammar must take that token before the next bitmask), so the answers, forced
    tokens included, are those of one step at a time; once it ended, the free request's steps go ahead."""
    found = {}
    num_waits = 0
    for ahead in (False, True):
        core = core_with(grammars, max_num_batched_tokens=64)
        core.add_request(b"a", request("c", schema(POINT), prompt_len=100), [])
        core.add_request(b"a", request("free", None, max_tokens=60, prompt_len=30), [])
        wait_for_grammars(core)
        outputs: dict[bytes, list[RequestOutput]] = {}
        while core.has_work or core.in_flight:
            for client, outs in core.advance(ahead=ahead).items():
                outputs.setdefault(client, []).extend(outs)
            constrained = core.scheduler.requests.get("c")
            if constrained is not None and constrained.num_pending_outputs:
                assert not core.can_schedule_ahead and len(core.in_flight) == 1
                num_waits += 1
        found[ahead] = answers(outputs)
        counters = core.stats().counters
        num_ahead = counters.get("engine_steps_ahead_total", 0)
        assert (num_ahead > 0) == ahead
    assert found[True] == found[False]
    assert found[True]["free"][1] is FinishReason.LENGTH and len(found[True]["free"][0]) == 60
    jsonschema.validate(json.loads(tokenizer.decode(found[True]["c"][0])), POINT)
    assert num_waits >= 2  # the constrained request sampled with a step in flight, in both runs


def test_a_request_waits_for_its_grammar_without_holding_a_slot(grammars: GrammarCompiler) -> None:
    """One running place: a request whose grammar compiles for seconds does not keep an unconstrained
    request behind it from running to its end meanwhile."""
    huge_enum = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"enum": [f"v{i}" for i in range(30000)]}))
    core = core_with(grammars, max_num_seqs=1)
    core.add_request(b"a", request("slow", huge_enum), [])
    core.add_request(b"a", request("quick", None, max_tokens=3), [])
    assert grammars.stats.num_misses == 1 and core.grammar_tickets
    found = answers(run_until_idle(core, MAX_STEPS))
    assert found["quick"][1] is FinishReason.LENGTH
    assert core.grammar_tickets, "the compile took longer than the quick request: it did not wait for it"
    assert not core.has_work and core.holds_requests  # nothing to step, one request held
    wait_for_grammars(core)
    assert answers(run_until_idle(core, MAX_STEPS))["slow"][1] is FinishReason.STOP


def test_the_cache_shares_compiles_and_counts(grammars: GrammarCompiler) -> None:
    core = core_with(grammars)
    core.add_request(b"a", request("one", schema(POINT)), [])
    core.add_request(b"a", request("two", schema(POINT)), [])  # most often while the first compile runs
    wait_for_grammars(core)
    # the second joined the running compile (a miss that compiles nothing), or, where that compile had
    # already ended (its thread can finish before add_request returns), hit its result
    misses, hits = grammars.stats.num_misses, grammars.stats.num_hits
    assert (misses, hits) in ((2, 0), (1, 1))
    assert len(grammars.stats.compile_seconds) == 1  # one compile for both
    core.add_request(b"a", request("three", schema(POINT)), [])
    assert not core.grammar_tickets  # a hit is ready at once
    assert (grammars.stats.num_misses, grammars.stats.num_hits) == (misses, hits + 1)
    core.add_request(b"a", request("four", schema(POINT, any_whitespace=False)), [])  # another constraint
    assert grammars.stats.num_misses == misses + 1
    wait_for_grammars(core)
    found = answers(run_until_idle(core, MAX_STEPS))
    assert found["one"] == found["two"] == found["three"]
    stats = core.stats()
    assert stats.counters["structured_output_cache_hits_total"] == hits + 1
    assert stats.counters["structured_output_cache_misses_total"] == misses + 1
    assert len(stats.observations["structured_output_compile_seconds"]) == 2
    assert stats.gauges["structured_output_cache_bytes"] == grammars.cache_bytes > 0


def test_the_cache_is_bounded_in_bytes(tokenizer_dir: Path) -> None:
    def upto(maximum: int) -> Constraint:
        return schema(
            {**POINT, "properties": {**POINT["properties"], "x": {"type": "integer", "maximum": maximum}}}
        )

    grammars = compiler(tokenizer_dir)
    core = core_with(grammars)
    core.add_request(b"a", request("probe", upto(90)), [])
    wait_for_grammars(core)
    one_grammar = grammars.cache_bytes
    grammars.close()
    grammars = compiler(tokenizer_dir, cache_bytes=one_grammar + one_grammar // 2)  # room for one
    core = core_with(grammars)
    for req_id, maximum in [("a", 90), ("b", 80), ("c", 90)]:
        core.add_request(b"a", request(req_id, upto(maximum)), [])
        wait_for_grammars(core)
    assert grammars.stats.num_misses == 3  # "b" evicted "a"
    assert grammars.cache_bytes <= one_grammar + one_grammar // 2
    grammars.close()


def test_a_bad_constraint_fails_its_request_only(grammars: GrammarCompiler) -> None:
    core = core_with(grammars)
    # The compile may fail before add_request returns: then add_request itself answers.
    at_once = core.add_request(b"a", request("bad", Constraint(ConstraintKind.REGEX, "(ab")), [])
    core.add_request(b"a", request("good", None, max_tokens=2), [])
    [failed] = [*at_once.get(b"a", []), *wait_for_grammars(core).get(b"a", [])]
    assert failed.req_id == "bad" and failed.finish_reason is FinishReason.ABORT
    assert failed.error is not None and (failed.error.code, failed.error.http_status) == (
        "invalid_constraint",
        400,
    )
    assert "parenthesis" in failed.error.message and "/project/" not in failed.error.message
    assert answers(run_until_idle(core, MAX_STEPS))["good"][1] is FinishReason.LENGTH
    assert core.stats().counters["structured_output_compile_failures_total"] == 1


def test_a_compile_past_the_timeout_fails_the_request_and_lands_in_the_cache(tokenizer_dir: Path) -> None:
    grammars = compiler(tokenizer_dir, timeout_s=0.2)
    huge_enum = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"enum": [f"v{i}" for i in range(30000)]}))
    core = core_with(grammars)
    core.add_request(b"a", request("slow", huge_enum), [])
    [failed] = wait_for_grammars(core)[b"a"]
    assert failed.error is not None and failed.error.code == "constraint_compile_timeout"
    assert core.stats().counters["structured_output_compile_timeouts_total"] == 1
    deadline = time.monotonic() + 60
    while grammars.num_compiling():  # the abandoned compile runs on to its end
        assert time.monotonic() < deadline
        time.sleep(0.05)
    core.add_request(b"a", request("again", huge_enum), [])
    assert not core.grammar_tickets  # ready at once: a hit
    grammars.close()


def slow_schema(variant: int) -> Constraint:
    """Seconds of xgrammar's compile over the tiny vocabulary (and ~6 MB): 1,500 optional properties,
    compact (their compile time grows far faster than their number)."""
    properties = {f"p{i}": {"type": "string"} for i in range(1500 + variant)}
    return schema({"type": "object", "properties": properties}, any_whitespace=False)


def test_compiles_nobody_waits_for_are_dropped_and_overrunning_ones_refused_at_once(
    tokenizer_dir: Path,
) -> None:
    """Three slow constraints at once: two compile (the threads), the third queues. All three requests
    time out; the queued compile is cancelled (it never runs), the running ones run to their end. A
    repeat of a running one is refused at once, and so is one whose compile overran and whose grammar
    the cache could not keep, after the compile ended; a small constraint is then served."""
    grammars = compiler(tokenizer_dir, cache_bytes=1 << 20, timeout_s=0.3)
    core = core_with(grammars)
    failed = []  # (an add_request answers the requests whose wait ended meanwhile: a slow machine's)
    for variant in range(3):
        failed += core.add_request(b"a", request(f"slow-{variant}", slow_schema(variant)), []).get(b"a", [])
    failed += wait_for_grammars(core)[b"a"]
    assert sorted(out.req_id for out in failed) == ["slow-0", "slow-1", "slow-2"], grammars.stats
    assert all(out.error is not None and out.error.code == "constraint_compile_timeout" for out in failed)
    # two threads: at most two compiles ran (one may already have ended on a machine slow to poll)
    assert grammars.num_compiling() <= 2
    started = time.monotonic()
    [again] = core.add_request(b"a", request("again", slow_schema(0)), [])[b"a"]
    assert again.error is not None and again.error.code == "constraint_compile_timeout"
    assert time.monotonic() - started < 0.3  # at once, not at the timeout
    deadline = time.monotonic() + 120
    while grammars.num_compiling():  # the two running compiles end on their own
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the queued compile was cancelled (it never ran), unless the test thread, starved while compiles
    # ran on a busy machine, released its ticket only after a thread had freed and started it
    assert len(grammars.stats.compile_seconds) in (2, 3)
    assert core.stats().counters["structured_output_compile_timeouts_total"] == 4
    assert grammars.cache_bytes == 0  # ~6 MB each: not kept by a 1 MiB cache
    [refused] = core.add_request(b"a", request("later", slow_schema(1)), [])[b"a"]
    assert refused.error is not None and refused.error.code == "constraint_compile_timeout"
    assert grammars.num_compiling() == 0  # refused without compiling it again
    core.add_request(b"a", request("small", schema(POINT)), [])
    wait_for_grammars(core)
    assert answers(run_until_idle(core, MAX_STEPS))["small"][1] is FinishReason.STOP
    grammars.close()


def test_any_failure_inside_a_compile_fails_its_request_only(
    grammars: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception xgrammar is not expected to raise (out of memory, a fault of its own) ends the
    request with an error, never the engine's loop."""
    core = core_with(grammars)
    core.add_request(b"a", request("warm", schema(POINT)), [])  # loads the backend
    wait_for_grammars(core)
    [backend] = grammars._backends.values()
    faults = {"big": MemoryError(), "odd": OSError("xgrammar fault")}

    def failing(constraint: Constraint) -> None:
        raise faults[json.loads(constraint.spec)["title"]]

    monkeypatch.setattr(backend, "compile", failing)
    added = [core.add_request(b"a", request(name, schema({**POINT, "title": name})), []) for name in faults]
    # a fast failure may come back from add_request itself
    failed = [out for outs in [*added, wait_for_grammars(core)] for out in outs.get(b"a", [])]
    outputs = {out.req_id: out for out in failed}
    found = {name: (out.error.code, out.error.http_status) for name, out in outputs.items() if out.error}
    assert found == {"big": ("constraint_too_large", 400), "odd": ("constraint_compile_failed", 500)}
    assert answers(run_until_idle(core, MAX_STEPS))["warm"][1] is FinishReason.STOP


def test_the_matcher_follows_a_preempted_request(
    grammars: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """A KV pool too small for two answers at once: one is preempted mid-answer and recomputed; both
    answers still validate (the matcher kept the tokens the request kept)."""
    words = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 40}},
        "required": ["s"],
    }
    worker = StandinWorker(vocab_size=VOCAB_SIZE, num_kv_blocks=13, block_size=16)
    core = core_with(grammars, worker)
    for req_id in ("p", "q"):
        added = core.add_request(
            b"a", request(req_id, schema(words, False), max_tokens=100, prompt_len=90), []
        )
        assert not added.get(b"a")  # admitted (prompt and output fit the pool), nothing answered yet
    wait_for_grammars(core)
    found = answers(run_until_idle(core, MAX_STEPS))
    assert core.scheduler.num_preemptions > 0
    for tokens, reason in found.values():
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), words)
        assert reason is FinishReason.STOP


def test_aborted_while_compiling_and_a_failed_step(grammars: GrammarCompiler) -> None:
    worker = StandinWorker(vocab_size=VOCAB_SIZE, fail_steps={1: "CUDA error"})
    core = core_with(grammars, worker)
    huge_enum = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"enum": [f"w{i}" for i in range(20000)]}))
    core.add_request(b"a", request("gone", huge_enum), [])
    assert core.scheduler.num_awaiting_grammar == 1
    from wire.protocol import Abort

    [aborted] = core.abort(b"a", Abort(["gone"]))[b"a"]
    assert aborted.finish_reason is FinishReason.ABORT
    assert core.scheduler.num_awaiting_grammar == 0 and not core.holds_requests
    assert core.resolve_grammars() == {} and not core.grammar_tickets
    core.add_request(b"a", request("failed", schema(POINT)), [])
    wait_for_grammars(core)
    [out] = core.step()[b"a"]
    assert out.error is not None and out.error.http_status == 500
    core.add_request(b"a", request("after", schema(POINT)), [])
    assert answers(run_until_idle(core, MAX_STEPS))["after"][1] is FinishReason.STOP


def test_a_grammar_complete_before_any_token_ends_at_once(grammars: GrammarCompiler) -> None:
    core = core_with(grammars)
    # The compile may end before add_request returns: then add_request itself answers.
    at_once = core.add_request(b"a", request("empty", Constraint(ConstraintKind.GRAMMAR, 'root ::= ""')), [])
    [out] = [*at_once.get(b"a", []), *wait_for_grammars(core).get(b"a", [])]
    assert (out.new_token_ids, out.finish_reason, out.error) == ([], FinishReason.STOP, None)
    assert not core.holds_requests


def test_forced_tokens_of_a_request_preempted_in_a_step_the_worker_never_read_go_out_again(
    grammars: GrammarCompiler,
) -> None:
    """A constrained request with forced tokens pending is preempted in a step that the worker could
    not decode, so it applied nothing of it. The step's forced tokens and preemption go out again with
    the next step (``Scheduler.fail_step``): the worker's copy of the request's tokens stays the
    engine's, and when the request resumes it answers as in a run without the failure. (Without the
    re-send the stand-in refuses the resumed span: it lacks the forced tokens.) The plain request the
    failed step ran ends with an error, as every request of a failed step does."""

    def run(
        undecodable_steps: set[int],
    ) -> tuple[dict[str, tuple[list[int], FinishReason | None]], StandinWorker]:
        # 5 blocks of 16: "d" (40 prompt tokens) grows until "c" (20) must give its blocks back
        worker = StandinWorker(
            vocab_size=VOCAB_SIZE, num_kv_blocks=5, block_size=16, undecodable_steps=undecodable_steps
        )
        core = core_with(grammars, worker)
        core.add_request(b"a", request("d", None, max_tokens=20, prompt_len=40), [])
        core.add_request(b"a", request("c", schema(POINT, any_whitespace=False), max_tokens=40), [])
        wait_for_grammars(core)  # before any step: "d" is admitted first, "c" second
        return answers(run_until_idle(core, MAX_STEPS)), worker

    clean, worker = run(set())
    [step] = [  # the step that preempts "c" while its forced tokens go to the worker
        s.sched.step_id
        for s in worker.steps
        if "c" in s.sched.preempted_req_ids and "c" in s.sched.forced_tokens
    ]
    failed, worker = run({step})
    assert failed["c"] == clean["c"] and clean["c"][1] is FinishReason.STOP
    assert failed["d"][1] is FinishReason.ABORT
    [after] = [s.sched for s in worker.steps if s.sched.step_id == step + 1]
    assert after.preempted_req_ids == ["c"] and "c" in after.forced_tokens  # sent again


def test_forced_tokens_reach_the_worker_with_the_next_step_and_none_are_forced_with_logprobs(
    grammars: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Where a constant's grammar allows one token only, that token comes out with the sampled one and
    reaches the worker with the next step, at its place in the answer (the stand-in refuses a span past
    the tokens it has); a request that asks for logprobs samples every token (a forced one has no
    logits), and both answers are the constant."""
    const = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"const": "abcdefghij klmnopqrst"}))
    worker = StandinWorker(vocab_size=VOCAB_SIZE)
    core = core_with(grammars, worker)
    core.add_request(b"a", request("c", const), [])
    wait_for_grammars(core)
    tokens, reason = answers(run_until_idle(core, MAX_STEPS))["c"]
    assert reason is FinishReason.STOP and json.loads(tokenizer.decode(tokens)) == "abcdefghij klmnopqrst"
    sent = [step.sched.forced_tokens["c"] for step in worker.steps if "c" in step.sched.forced_tokens]
    for num_before, forced in sent:
        assert tokens[num_before - 20 : num_before - 20 + len(forced)] == forced  # 20 prompt tokens
    # the last ones, which end the answer, are never sent: nothing computes them
    assert 0 < sum(len(forced) for _, forced in sent) <= core.scheduler.num_forced_tokens

    core = core_with(grammars)
    with_logprobs = SamplingParams(max_tokens=200, eos_token_ids=(EOS,), num_top_logprobs=0)
    core.add_request(b"a", AddRequest("lp", list(range(3, 23)), with_logprobs, constraint=const), [])
    wait_for_grammars(core)
    sampled, reason = answers(run_until_idle(core, MAX_STEPS))["lp"]
    assert core.scheduler.num_forced_tokens == 0 and reason is FinishReason.STOP
    assert json.loads(tokenizer.decode(sampled)) == "abcdefghij klmnopqrst"


def test_a_grammar_ready_only_after_the_wait_ended_is_a_timeout_however_late_the_poll(
    tokenizer_dir: Path,
) -> None:
    """The wait is measured to when the grammar became ready, not to when a busy loop looked."""
    grammars = compiler(tokenizer_dir, cache_bytes=1 << 30, timeout_s=0.3)
    warm = grammars.request(schema(POINT), VOCAB_SIZE)  # loads the backend first
    while grammars.poll(warm) is None:
        time.sleep(0.01)
    ticket = grammars.request(slow_schema(0), VOCAB_SIZE)
    assert ticket.future is not None
    ticket.future.result(120)  # not polled until the compile ended, seconds past the deadline
    with pytest.raises(CompileError, match="took longer than 0.3 s"):
        grammars.poll(ticket)
    grammars.close()
