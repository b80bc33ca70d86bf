"""How long ``serve``'s supervisor waits before it starts a dead role again (app/launch/supervisor.py)."""

from __future__ import annotations

from app.launch.supervisor import Supervisor, restart_delay


def test_a_first_death_restarts_at_once_then_the_waits_double_to_eight_seconds() -> None:
    waits = [restart_delay(n) for n in range(Supervisor.MAX_RESTARTS + 2)]
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    # a role that keeps dying is given up within the window, after the waits before its last restarts
    assert sum(waits[: Supervisor.MAX_RESTARTS]) < Supervisor.RESTART_WINDOW_S
