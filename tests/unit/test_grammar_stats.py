"""The structured-output figures in the engine's stats (engine/stats.py): a compile that ended since the
last stats message goes out with them at once, its seconds beside the gauge that no longer counts it."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_structured_engine import POINT, VOCAB_SIZE, compiler, core_with, schema, tokenizer_dir
from wire.metric_names import EngineGauge, EngineObservation

__all__ = ["tokenizer_dir"]  # (the module's fixture)


def test_a_compile_that_ended_unseen_is_counted_with_the_gauge_that_drops_it(tokenizer_dir: Path) -> None:
    grammars = compiler(tokenizer_dir)
    core = core_with(grammars)
    first = core.stats()  # (drains what came before)
    assert first.gauges[str(EngineGauge.GRAMMAR_COMPILES_RUNNING)] == 0
    ticket = grammars.request(schema(POINT), VOCAB_SIZE)
    assert ticket.future is not None
    ticket.future.result(60)  # it ended, and nobody has looked since
    stats = core.stats()
    assert stats.gauges[str(EngineGauge.GRAMMAR_COMPILES_RUNNING)] == 0
    assert len(stats.observations.get(str(EngineObservation.GRAMMAR_COMPILE_SECONDS), [])) == 1
    grammars.close()
