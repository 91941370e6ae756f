"""Loaded at start-up by a Python process whose PYTHONPATH names this directory: a runner started
under libfaketime by tests/support/faketime.py. It replaces `time.sleep` with a wait in
`select()`, and changes nothing else.

Why: a host whose wall clock is an hour off still has a working monotonic clock. libfaketime
0.9.10 (Debian's) cannot give a CPython 3.11 process that: with CLOCK_MONOTONIC faked, every timed
lock wait (`threading.Event.wait`, `Thread.join(timeout)`; `sem_clockwait`, which libfaketime does
not intercept) gets a deadline decades away and never returns; with FAKETIME_DONT_FAKE_MONOTONIC=1
it does return, but `time.sleep` (`clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`, which
libfaketime converts as if its deadline were on the faked wall clock) fails with EINVAL. So the
runner runs with FAKETIME_DONT_FAKE_MONOTONIC=1, and its sleeps go through `select()`, whose
relative timeout libfaketime passes on unchanged."""

from __future__ import annotations

import os
import select
import time

if "faketime" in os.environ.get("LD_PRELOAD", ""):

    def _sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            select.select([], [], [], left)

    time.sleep = _sleep
