"""Audit 11 (hostile input to fila itself): each finding's attack refused, its allowed twin kept."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fila import jobdir
from fila.errors import FilaError
from fila.policy import load_policy, narrow

from .helpers import make_root, shell_task

# -- 1. the copy race: a directory swapped for a symlink while fila copies ----------------------

_RACER = textwrap.dedent(
    """
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    a, b, stop = (os.fsencode(x) for x in sys.argv[1:4])
    open(sys.argv[4], "w").close()  # ready
    while not os.path.exists(stop):
        libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
    """
)


def _has_renameat2() -> bool:
    return hasattr(ctypes.CDLL(None), "renameat2")


@pytest.mark.skipif(not _has_renameat2(), reason="needs renameat2 (glibc >= 2.28)")
def test_copy_never_lands_a_file_from_outside_the_project_while_a_directory_is_swapped(
    tmp_path: Path,
) -> None:
    root = make_root(tmp_path / "proj").require()
    outside = tmp_path / "outside"
    outside.mkdir()
    d = root.path / "d"
    (d / "x").mkdir(parents=True)
    names = [f"f{i}" for i in range(8)]
    for n in names:
        (d / "x" / n).write_text("decoy\n")
        (outside / n).write_text("SECRET\n")
    os.symlink(outside, d / "y")
    policy, _ = load_policy(root, "default")
    task = shell_task(targets=["d"])
    eff = narrow(policy, task)

    # The allowed counterpart, with nothing racing: the directory's files are copied.
    prep = jobdir.prepare(root, "calm", task, policy, eff)
    for side in ("input", "work"):
        assert (prep.job_dir / side / "d" / "x" / "f0").read_text() == "decoy\n"
        assert os.readlink(prep.job_dir / side / "d" / "y") == str(outside)

    stop, ready = tmp_path / "stop", tmp_path / "ready"
    racer = subprocess.Popen(
        [sys.executable, "-c", _RACER, str(d / "x"), str(d / "y"), str(stop), str(ready)]
    )
    copied = refused = 0
    try:
        while not ready.exists():
            pass
        for i in range(400):
            try:
                prep = jobdir.prepare(root, f"race{i % 4}", task, policy, eff)
            except (FilaError, OSError):
                refused += 1  # a tree that changed under the copy: that task's failure
                continue
            for side in ("input", "work"):
                for dirpath, _dirs, files in os.walk(prep.job_dir / side):
                    for f in files:
                        p = Path(dirpath, f)
                        if not p.is_symlink():
                            assert p.read_text() == "decoy\n", f"{p} came from outside the project"
                            copied += 1
    finally:
        stop.touch()
        racer.wait(timeout=30)
    assert copied > 0, "the race left nothing to check"


# -- 8. resolve_targets keeps order and drops repeats in linear time ---------------------------


def test_many_targets_resolve_once_each_in_order(tmp_path: Path) -> None:
    root = make_root(tmp_path).require()
    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text("x\n")
    policy, _ = load_policy(root, "default")
    names = ["t2.txt", "t0.txt", "t2.txt", "./t1.txt", "t0.txt"] * 4000
    assert jobdir.resolve_targets(root, root.path, names, policy) == ["t2.txt", "t0.txt", "t1.txt"]
    with pytest.raises(FilaError):
        jobdir.resolve_targets(root, root.path, [*names, "missing.txt"], policy)
