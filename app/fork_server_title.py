"""Imported by the fork server alone, as the first of its preloaded modules (app/child_processes.py):
names it as ``ps`` and ``top`` show it, beside the roles it forks."""

import setproctitle

setproctitle.setproctitle("mmserve: fork server")
