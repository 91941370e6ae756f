"""Deterministic (seeded) projects to benchmark on, and the change an engine would leave."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "value",
    "result",
    "items",
    "config",
    "parse",
    "render",
    "client",
    "server",
    "buffer",
    "index",
    "count",
    "total",
    "error",
    "state",
    "handler",
    "request",
    "response",
    "module",
)


@dataclass(frozen=True)
class Project:
    path: Path
    files: list[str]  # relative paths, sorted
    bytes: int
    binary: int  # how many of the files are binary


def _line_pool(rng: random.Random, n: int = 2000) -> list[str]:
    pool = []
    for _ in range(n):
        indent = " " * (4 * rng.randint(0, 3))
        a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        pool.append(
            rng.choice(
                (
                    f"{indent}{a}_{b} = {c}({rng.randint(0, 9999)})\n",
                    f"{indent}def {a}_{b}(self, {c}):\n",
                    f"{indent}return self.{a}[{rng.randint(0, 99)}] + {b}_{c}\n",
                    f"{indent}# {a} {b} {c}: {rng.randint(0, 10**6)}\n",
                    "\n",
                )
            )
        )
    return pool


def make_project(
    dest: Path,
    files: int,
    *,
    seed: int = 0,
    binary_every: int = 10,
    text_bytes: tuple[int, int] = (1024, 8192),
    binary_bytes: tuple[int, int] = (64 << 10, 256 << 10),
    per_dir: int = 50,
) -> Project:
    """`files` files under `dest`, `per_dir` to a directory, one in `binary_every` binary.

    The defaults average about 20 KB a file: 10,000 files make about 200 MB, most of it binary.
    """
    rng = random.Random(seed)
    pool = _line_pool(rng)
    dest.mkdir(parents=True, exist_ok=True)
    rels: list[str] = []
    total = nbin = 0
    for i in range(files):
        d = f"pkg{i // (per_dir * 10):03d}/mod{(i // per_dir) % 10}"
        if binary_every and i % binary_every == binary_every - 1:
            rel = f"{d}/blob{i:05d}.bin"
            data = rng.randbytes(rng.randint(*binary_bytes))
            nbin += 1
        else:
            rel = f"{d}/file{i:05d}.py"
            size = rng.randint(*text_bytes)
            data = "".join(rng.choices(pool, k=size // 28 + 1)).encode()[:size].rstrip(b"\n") + b"\n"
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        rels.append(rel)
        total += len(data)
    (dest / "README.md").write_text("a generated project for fila's benchmarks\n")
    rels.append("README.md")
    return Project(dest, sorted(rels), total + 42, nbin)


def mutate(work: Path, files: list[str], *, seed: int = 1) -> int:
    """What an engine might leave in `work/`: ten text files edited, one binary changed, one file
    deleted, one text and one binary file added. The same paths for the same seed. Returns the
    number of paths changed."""
    rng = random.Random(seed)
    texts = [f for f in files if f.endswith(".py")]
    bins = [f for f in files if f.endswith(".bin")]
    for rel in rng.sample(texts, min(10, len(texts))):
        p = work / rel
        lines = p.read_bytes().split(b"\n")
        lines.insert(len(lines) // 2, b"    changed = True  # edited by the engine")
        p.write_bytes(b"\n".join(lines))
    changed = min(10, len(texts))
    if bins:
        p = work / rng.choice(bins)
        data = bytearray(p.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = rng.randbytes(64)
        p.write_bytes(bytes(data))
        changed += 1
    if texts:
        (work / rng.choice(texts)).unlink(missing_ok=True)
        changed += 1
    (work / "added.py").write_text("print('added by the engine')\n")
    (work / "added.bin").write_bytes(rng.randbytes(4096))
    return changed + 2
