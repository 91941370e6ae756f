"""Fuzz fila's loaders of untrusted input for a fixed budget, and report what it found.

    .venv/bin/python -m bench.fuzz --seconds 60

Targets: a task file as a worker reads it from fila/in/ (parse_task_file, then check_task
against a real queue root), a task on stdin (`fila submit -`: parse_task_bytes), and a policy
file (load_policy). Inputs come from hypothesis strategies (shared with
tests/test_hostile_intake.py): arbitrary bytes, JSON of any shape, NaN/Infinity, huge and
long numbers, deep nesting, duplicate keys, strings with NUL, control, bidi and lone-surrogate
characters, and task- and policy-shaped documents with one field made hostile.

Every input must end as a value or as an InvalidInput (exit 2, a message naming the problem).
Anything else is a crash: its type, message and the input are printed, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# -- strategies ------------------------------------------------------------------------------

NASTY_CHARS = [
    "\x00",
    "\x01",
    "\x1b[31m",
    "\x7f",
    "\x85",
    "\n",
    "\r",
    "\t",
    "\u2028",
    "\u202e",
    "\u2066",
    "\u200f",
    "\ud800",
    "\udfff",
    "\ufeff",
    "\uffff",
    "..",
    "/",
    "~",
    "*",
    "-",
    " ",
    "é",
    "\U0001f600",
]
hostile_text = st.lists(st.one_of(st.sampled_from(NASTY_CHARS), st.text(max_size=8)), max_size=6).map("".join)
huge_ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 10**31, -(10**40)]),
)
any_floats = st.floats(allow_nan=True, allow_infinity=True)
json_scalars = st.one_of(st.none(), st.booleans(), huge_ints, any_floats, hostile_text)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(hostile_text, kids, max_size=4)),
    max_leaves=12,
)


def dumps(value: Any) -> bytes:
    """JSON as a hostile writer would: NaN and Infinity allowed, surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


raw_tricks = st.one_of(
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 200_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(1, 200_000).map(lambda n: b"[" * n),
    st.integers(20, 20_000).map(lambda n: b'{"engine":"shell","targets":["a"],"timeout":' + b"9" * n + b"}"),
    st.sampled_from(
        [
            b"NaN",
            b"-Infinity",
            b'{"engine":"shell","targets":["a"],"timeout":NaN}',
            b'{"engine":"shell","targets":["a"],"limits":{"cpus":1e400}}',
            b'{"engine":"shell","engine":"claude","targets":["a"]}',
            b'{"engine":"shell","targets":["\\ud800"]}',
            b'{"engine":"shell","targets":["a\\u0000b"]}',
            b"\xef\xbb\xbf{}",
            b"\xff\xfe{\x00}\x00",
            b"",
            b"\x00" * 64,
        ]
    ),
)

TASK_FIELDS = {
    "id": st.one_of(hostile_text, json_values),
    "prompt": st.one_of(hostile_text, json_values),
    "engine": st.one_of(st.sampled_from(["shell", "claude", "codex", "nope"]), hostile_text, json_values),
    "model": st.one_of(hostile_text, json_values),
    "timeout": st.one_of(huge_ints, any_floats, json_values),
    "targets": st.one_of(st.lists(hostile_text, max_size=3), json_values),
    "policy": st.one_of(st.sampled_from(["default", "nope"]), hostile_text, json_values),
    "command": st.one_of(hostile_text, json_values),
    "fallback": st.one_of(st.lists(hostile_text, max_size=2), json_values),
    "project": st.one_of(hostile_text, json_values),
    "image": st.one_of(hostile_text, json_values),
    "limits": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "memory": st.one_of(hostile_text, huge_ints, st.sampled_from(["1k", "6m", "9" * 40 + "g"])),
                "cpus": st.one_of(huge_ints, any_floats, hostile_text),
                "pids": st.one_of(huge_ints, any_floats, hostile_text),
            },
        ),
        json_values,
    ),
}
BASE_TASK: dict[str, Any] = {"engine": "shell", "command": "true", "targets": ["greeting.txt"]}
task_docs = st.builds(
    lambda over, drop: {**{k: v for k, v in BASE_TASK.items() if k not in drop}, **over},
    st.dictionaries(st.sampled_from(sorted(TASK_FIELDS)), st.just(None), max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({k: TASK_FIELDS[k] for k in keys})
    ),
    st.sets(st.sampled_from(sorted(BASE_TASK)), max_size=1),
)
task_bytes = st.one_of(st.binary(max_size=256), json_values.map(dumps), task_docs.map(dumps), raw_tricks)

POLICY_FIELDS = {
    "network": st.one_of(st.sampled_from(["none", "bridge", "host"]), hostile_text),
    "max_timeout_ms": st.one_of(huge_ints, any_floats),
    "default_timeout_ms": st.one_of(huge_ints, any_floats),
    "grace_ms": st.one_of(huge_ints, any_floats),
    "memory": st.one_of(hostile_text, st.sampled_from(["1k", "2g", "9" * 40 + "g", "-1m"])),
    "cpus": st.one_of(huge_ints, any_floats),
    "pids": st.one_of(huge_ints, any_floats),
    "nofile": st.one_of(huge_ints, any_floats),
    "fsize": st.one_of(hostile_text, huge_ints),
    "tmpfs": st.one_of(st.dictionaries(st.sampled_from(["tmp", "home"]), hostile_text), json_values),
    "deny": st.one_of(st.lists(hostile_text, max_size=3), json_values),
    "images": st.one_of(st.lists(hostile_text, max_size=3), json_values),
    "runtime": st.one_of(st.none(), hostile_text),
    "max_diff_bytes": huge_ints,
    "max_consecutive_failures": huge_ints,
    "description": json_values,
}


def base_policy() -> dict[str, Any]:
    from fila.assets import shipped_dir

    return json.loads((shipped_dir("policies") / "default.json").read_text())


policy_docs = st.dictionaries(st.sampled_from(sorted(POLICY_FIELDS)), st.just(None), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: POLICY_FIELDS[k] for k in keys})
)
policy_bytes = st.one_of(
    st.binary(max_size=256),
    json_values.map(dumps),
    policy_docs.map(lambda over: dumps({**base_policy(), **over})),
    raw_tricks,
)

# -- targets ---------------------------------------------------------------------------------


def scratch_root(path: Path) -> Any:
    """A real queue root with a project file, as `fila init` makes it."""
    from tests.support.project import make_root

    root = make_root(path)
    (path / "greeting.txt").write_text("hello\n")
    return root


def load_task_file(root: Any, raw: bytes) -> str:
    from fila.run.intake import check_task, parse_task_file

    path = root.in_dir / "fuzz.json"
    path.write_bytes(raw)
    task = parse_task_file(path, expected_id="fuzz")
    check_task(root, task)
    return "accepted"


def load_task_stdin(root: Any, raw: bytes) -> str:
    from fila.run.intake import check_task, parse_task_bytes

    check_task(root, parse_task_bytes(raw, source="stdin"))
    return "accepted"


def load_policy_file(root: Any, raw: bytes) -> str:
    from fila.queue.policy import load_policy

    (root.policies_dir / "fuzz.json").write_bytes(raw)
    load_policy(root, "fuzz")
    return "accepted"


def outcome(fn: Callable[[Any, bytes], str], root: Any, raw: bytes) -> tuple[str, str | None]:
    """(kind, crash report or None): `accepted`, the InvalidInput class that refused it, or
    `CRASH <type>` for anything else."""
    from fila.core.errors import InvalidInput

    try:
        return fn(root, raw), None
    except InvalidInput as e:
        return type(e).__name__, None
    except Exception as e:
        return f"CRASH {type(e).__name__}", "".join(traceback.format_exception(e))


@dataclass
class Found:
    inputs: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    crashes: dict[str, tuple[bytes, str]] = field(default_factory=dict)

    def add(self, target: str, kind: str, raw: bytes, crash: str | None) -> None:
        self.inputs[target] += 1
        self.outcomes.setdefault(target, Counter())[kind] += 1
        if crash is not None:
            self.crashes.setdefault(f"{target}: {kind}", (raw[:300], crash))


TARGETS: dict[str, tuple[Callable[[Any, bytes], str], Any]] = {
    "task file (fila/in)": (load_task_file, task_bytes),
    "task on stdin": (load_task_stdin, task_bytes),
    "policy file": (load_policy_file, policy_bytes),
}


def _round(
    name: str,
    fn: Callable[[Any, bytes], str],
    strategy: Any,
    root: Any,
    found: Found,
    *,
    batch: int,
    seed: int | None,
) -> Callable[[], None]:
    @settings(
        max_examples=batch,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # crashes are collected, not raised: nothing to shrink
    )
    @given(raw=strategy)
    def one(raw: bytes) -> None:
        kind, crash = outcome(fn, root, raw)
        found.add(name, kind, raw, crash)

    return one


def fuzz(seconds: float, *, batch: int = 200, seed: int | None = None) -> Found:
    """Run every target in turn, `batch` hypothesis examples at a time, until the budget is spent."""
    found = Found()
    tmp = Path(tempfile.mkdtemp(prefix="fila-fuzz-"))
    try:
        root = scratch_root(tmp / "root")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, (fn, strategy) in TARGETS.items():
                if time.monotonic() >= deadline:
                    break
                _round(name, fn, strategy, root, found, batch=batch, seed=seed)()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return found


def report(found: Found, seconds: float) -> str:
    lines = [f"fuzzed fila's untrusted-input loaders for {seconds:g} s"]
    for target, n in found.inputs.items():
        kinds = ", ".join(f"{k} {v}" for k, v in found.outcomes[target].most_common())
        lines.append(f"  {target}: {n} inputs: {kinds}")
    lines.append(f"crashes (distinct target/type): {len(found.crashes)}")
    for key, (raw, tb) in found.crashes.items():
        lines += [f"--- {key}", f"input: {raw!r}", tb.rstrip()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60, help="the budget (default 60)")
    ap.add_argument("--batch", type=int, default=200, help="hypothesis examples per round and target")
    args = ap.parse_args(argv)
    found = fuzz(args.seconds, batch=args.batch)
    print(report(found, args.seconds))
    return 1 if found.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
