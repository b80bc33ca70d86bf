"""Reading a server's ``/metrics`` in tests: a reading refuses a name the server does not export, so a
renamed or dropped metric fails the test that reads it instead of reading as 0 (a ``delta(...) == 0``
such as "no encoder run on a hit" would otherwise pass on any misspelt name)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

# The sample suffixes of prometheus's families: a counter ``x`` exports ``x_total``, a histogram ``x_bucket``,
# ``x_sum`` and ``x_count`` (https://prometheus.io/docs/instrumenting/exposition_formats/).
SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


class UnknownMetric(AssertionError):
    """A test read a metric the server does not export (an AssertionError, so ``Mapping.get`` with a
    default does not swallow it)."""


class Metrics(Mapping[str, float]):
    """One reading of Prometheus text: sample values by ``name{labels}`` as the text spells them, and the
    families its ``# TYPE`` lines declare. A labelled sample of a declared family that has not appeared
    yet reads as 0 (prometheus shows a label set from its first increment on); any other name that is
    not there raises ``UnknownMetric``."""

    def __init__(self, samples: dict[str, float], families: set[str]) -> None:
        self.samples = samples
        self.families = families

    def __getitem__(self, name: str) -> float:
        if name in self.samples:
            return self.samples[name]
        sample_name, has_labels, _ = name.partition("{")
        if has_labels and self.family_of(sample_name) is not None:
            return 0.0
        raise UnknownMetric(f"the server exports no metric {name!r}")

    def family_of(self, sample_name: str) -> str | None:
        """The declared family a sample name belongs to, if any."""
        if sample_name in self.families:
            return sample_name
        for suffix in SAMPLE_SUFFIXES:
            base = sample_name.removesuffix(suffix)
            if base != sample_name and base in self.families:
                return base
        return None

    def __iter__(self) -> Iterator[str]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)


def parse_metrics(text: str) -> Metrics:
    """Prometheus text → a ``Metrics`` reading (its samples and declared families)."""
    samples: dict[str, float] = {}
    families: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return Metrics(samples, families)


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    """How much a metric sample grew between two readings (``Server.metrics()``); raises
    ``UnknownMetric`` if either reading lacks it."""
    return after[name] - before[name]
