"""Imported by the fork server alone, as the first of its preloaded modules (app/child_processes.py):
names it as ``ps`` and ``top`` show it, and ends it with the process that started it (PR_SET_PDEATHSIG),
even in the middle of its imports, which take seconds and during which it reads nothing."""

import ctypes
import signal
import sys

import setproctitle

setproctitle.setproctitle("mmserve: fork server")
if sys.platform.startswith("linux"):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
