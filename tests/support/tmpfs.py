"""A small real tmpfs for a test that needs a full disk (ENOSPC from the kernel, not a patched
call): mounted when this process may mount (root, no seccomp refusal), else the test is skipped
with the reason."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size: str = "256k") -> Iterator[Path]:
    """`where` (made here) as a tmpfs of `size` for the block, unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root and mount(2)): {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
