"""Start-up errors of the shared-memory object store: settings that cannot combine, and a ring too small
for one item, each named by its flags (``mmserve`` exits 2 before starting anything)."""

from __future__ import annotations

import pytest

from app.launch.cli import main
from app.settings import Settings


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--mm-ipc-cache-gb", "0"], ["--mm-ipc-cache-gb"]),
        (["--mm-processor-cache-gb", "0"], ["--mm-processor-cache-gb", "--mm-shm-cache-max-object-size-mb"]),
        (
            ["--mm-processor-cache-gb", "0.01", "--mm-shm-cache-max-object-size-mb", "64"],
            ["--mm-processor-cache-gb", "--mm-shm-cache-max-object-size-mb"],
        ),
    ],
    ids=["ipc-cache-off", "no-ring", "ring-smaller-than-an-item"],
)
def test_shm_settings_that_cannot_work_are_refused(
    flags: list[str], named: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--mm-processor-cache-type", "shm", *flags]) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in named), err


def test_shm_ring_of_one_item_is_accepted() -> None:
    settings = Settings(
        mm_processor_cache_type="shm", mm_processor_cache_gb=2 / 1024, mm_shm_cache_max_object_size_mb=1
    )
    assert settings.processor_cache_bytes >= settings.shm_max_object_bytes


def test_lru_ignores_the_object_limit() -> None:
    assert Settings(mm_processor_cache_gb=0, mm_ipc_cache_gb=0, mm_shm_cache_max_object_size_mb=999)
