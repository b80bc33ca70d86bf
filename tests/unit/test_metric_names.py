"""One list of engine metric names (wire/metric_names.py): the engine emits only its members, the API's
``/metrics`` exports every member, and docs/operations.md names every family ``/metrics`` shows."""

from __future__ import annotations

import re
from pathlib import Path

from app.metrics import ENGINE_BAD_MESSAGES, ENGINE_LABELLED_COUNTERS, ApiMetrics
from app.proxy.server import ProxyMetrics
from engine.ec_connector import ECConnectorScheduler
from tests.standin_worker import StandinWorker
from tests.unit.engine_core_support import add, engine_core, frames, run_until_idle
from wire.ec_store import ECRole
from wire.ec_store.shared_storage import SharedStorageStore
from wire.metric_names import EngineCounter, EngineGauge, EngineObservation
from wire.protocol import EngineStats

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_engine_emits_only_listed_names(tmp_path: Path) -> None:
    """A core with a connector over a real folder: an image encoded and saved, one loaded from the
    store, one served from the encoder cache."""
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    store.put("B", b"encoded by another instance")
    worker = StandinWorker(ec_store=store, ec_role=ECRole.BOTH, encoder_seconds=0.01, forward_seconds=0.02)
    core, _ = engine_core(worker, ECConnectorScheduler(store, ECRole.BOTH), enable_prefix_caching=True)
    core.add_request(b"a", add("r1", "A"), frames())
    core.add_request(b"a", add("r2", "B"), frames())
    run_until_idle(core)
    core.add_request(b"a", add("r3", "A", prompt_len=24), frames())
    run_until_idle(core)

    stats = core.stats()
    assert set(stats.counters) <= set(EngineCounter)
    assert set(stats.gauges) <= set(EngineGauge)
    assert set(stats.observations) <= set(EngineObservation)
    # the run reached the connector, the encoder and the LM (the check above is not vacuous)
    assert stats.counters[EngineCounter.EC_LOADS] == 1 and stats.counters[EngineCounter.EC_SAVES] == 1
    assert stats.counters[EngineCounter.ENCODER_CACHE_HITS] >= 1
    assert {EngineObservation.ENCODER_SECONDS, EngineObservation.FORWARD_SECONDS} <= set(stats.observations)


def _rendered_with_every_member() -> tuple[str, dict[str, float]]:
    """``/metrics`` after an ``EngineStats`` holding every member, each counter and gauge a value of its
    own (so a sample shows which member it came from); the values by member."""
    values = {name: float(i + 1) for i, name in enumerate([*EngineCounter, *EngineGauge])}
    stats = EngineStats(
        counters={c: values[c] for c in EngineCounter},
        gauges={g: values[g] for g in EngineGauge},
        observations={o: [0.5] for o in EngineObservation},
    )
    metrics = ApiMetrics()
    metrics.apply_engine_stats(stats)
    return metrics.render().decode(), values


def test_every_listed_name_is_exported() -> None:
    text, values = _rendered_with_every_member()
    samples = set(text.splitlines())
    labelled = {
        counter: f'mmserve_{family}_total{{{label}="{value}"}}'
        for family, (_, label, members) in ENGINE_LABELLED_COUNTERS.items()
        for value, counter in members.items()
    }
    labelled |= {
        counter: f'mmserve_bad_messages_total{{process="{process}",source="{source}"}}'
        for (process, source), counter in ENGINE_BAD_MESSAGES.items()
    }
    for counter in EngineCounter:
        sample = labelled.get(counter, f"mmserve_{counter}")
        assert f"{sample} {values[counter]}" in samples, counter
    for gauge in EngineGauge:
        assert f"mmserve_{gauge} {values[gauge]}" in samples, gauge
    for observation in EngineObservation:
        assert f"mmserve_{observation}_count 1.0" in samples, observation
        assert f"mmserve_{observation}_sum 0.5" in samples, observation


def test_every_family_on_metrics_is_documented() -> None:
    api_text, _ = _rendered_with_every_member()
    proxy_text = ProxyMetrics().render().decode()
    families = re.findall(r"^# TYPE (\S+) \S+$", api_text + proxy_text, flags=re.MULTILINE)
    assert len(families) > 40
    page = OPERATIONS.read_text(encoding="utf-8")
    missing = [family for family in families if f"`{family}`" not in page]
    assert not missing, f"docs/operations.md does not name {missing}"
