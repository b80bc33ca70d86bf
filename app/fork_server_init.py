"""Imported by the fork server alone, as the first of its preloaded modules (app/child_processes.py):
names it as ``ps`` and ``top`` show it, and ends it with the process that started it (PR_SET_PDEATHSIG),
even in the middle of its imports, which take seconds and during which it reads nothing.

It ignores SIGTERM: a SIGTERM to the whole process group (systemd's default stop, ``kill -TERM -PGID``)
is a drain, and a fork server ended by it would end its children too (their PR_SET_PDEATHSIG), the worker
in the middle of the requests being drained. So its own end is SIGKILL, when its starter exits; every
fork sets SIGTERM back to its default first (``leave_fork_server``)."""

import ctypes
import signal
import sys

import setproctitle

setproctitle.setproctitle("mmserve: fork server")
if sys.platform.startswith("linux"):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
signal.signal(signal.SIGTERM, signal.SIG_IGN)
