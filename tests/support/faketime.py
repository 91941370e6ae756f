"""A runner "host" whose wall clock is off, for tests/test_pg_faults.py: the environment that
starts a process under Debian's libfaketime with its wall clock moved by a fixed offset.

FAKETIME_DONT_FAKE_MONOTONIC=1 is needed: a host whose wall clock is wrong still has a working
monotonic clock, and with libfaketime 0.9.10 faking CLOCK_MONOTONIC too a CPython 3.11 process's
timed waits (`threading.Event.wait`, the lease renewer's) never return (see
tests/support/faketime_site/sitecustomize.py, loaded through PYTHONPATH, for the one call it breaks
the other way round, `time.sleep`, and how that is mended)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.pg import FAKETIME_LIB

SITE = Path(__file__).parent / "faketime_site"


def unavailable() -> str | None:
    """Why a process cannot be started under libfaketime here (a skip's reason), or None."""
    return None if FAKETIME_LIB.exists() else "no libfaketime: scripts/postgres-up installs faketime"


def skewed(env: dict[str, str], offset: str) -> dict[str, str]:
    """`env` with the wall clock moved by `offset` (libfaketime's syntax: "+1h", "-1h")."""
    path = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return {
        **env,
        "LD_PRELOAD": str(FAKETIME_LIB),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }
