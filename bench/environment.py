"""Case `environment`: what a project environment costs (docs/environments.md).

1. A task on a cached environment against the same task on the engine's own image
   (`--environment none`), claim to record (the record's `total`), alternating: the median
   difference, target <= 0.1 s.
2. A project whose setup makes a 20,000-file `node_modules` (provided): a later task's prepare and
   diff against `cp -a` of that tree (what copying it per job would cost): target <= 0.05x.
3. The first build of a small Python project (pip install pytest from a local index through the
   gateway) and of a small Node project (npm install from a local registry), and the second task's
   setup time (none): reported. The indexes are the tests' (tests/support/pkgindex.py), on a sealed
   network: nothing leaves the machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import Ctx, Row, alternate, fila_cmd, median, run

BASE = "fila/testenv:latest"
MODULES = 20_000
TARGET_CACHED_S = 0.1
TARGET_PROVIDED = 0.05


def _root(ctx: Ctx, name: str, decl: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    root = ctx.mkdtemp(name) / "p"
    root.mkdir()
    run([*fila_cmd(), "init", "--root", str(root)])
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "fila-environment.json").write_text(json.dumps(decl))
    return root


def _policy(root: Path, **env: Any) -> None:
    path = root / "policies" / "default.json"
    doc = json.loads(path.read_text())
    doc["environment"] = {"allow": [], "timeout_ms": 600_000, **env}
    path.write_text(json.dumps(doc))


def _task(root: Path, *extra: str) -> dict[str, Any]:
    res = run([*fila_cmd(), "submit", "--root", str(root), "--engine", "shell", "--command", "true",
               "--target", ".", "--json", "--run", "--quiet", *extra], stdout=subprocess.PIPE)  # fmt: skip
    return json.loads(res.stdout)


def _ensure_testenv() -> None:
    run([*fila_cmd(), "images", "build", "testenv", "--ca-file", "/etc/ssl/certs/ca-certificates.crt"])


def environment(ctx: Ctx) -> list[Row]:
    _ensure_testenv()
    return [_cached(ctx), _provided(ctx), *_first_builds(ctx)]


def _cached(ctx: Ctx) -> Row:
    root = _root(
        ctx, "env-cached", {"image": BASE, "setup": [{"name": "s", "shell": "true"}]}, {"a.txt": "a\n"}
    )
    _policy(root)
    _task(root)  # builds it
    reps = ctx.reps_or(9, 3)
    env_t, none_t = alternate(
        lambda: _task(root)["timings"]["total"],
        lambda: _task(root, "--environment", "none")["timings"]["total"],
        reps,
    )
    diff = median(env_t) - median(none_t)
    return Row(
        "environment: cached task vs the engine's image (claim to record)",
        round(median(env_t), 3),
        round(median(none_t), 3),
        "s",
        target=f"+ <= {TARGET_CACHED_S} s",
        ok=diff <= TARGET_CACHED_S,
        note=f"median difference {diff:+.3f} s over {reps} alternating pairs",
        samples={"environment": env_t, "none": none_t},
    )


def _provided(ctx: Ctx) -> Row:
    fill = f"seq 1 {MODULES} | while read i; do echo $i > f$i.js; done"
    make = f"mkdir -p node_modules && cd node_modules && {fill}"
    root = _root(
        ctx,
        "env-provided",
        {"image": BASE, "setup": [{"name": "modules", "shell": make}], "provided": ["node_modules"]},
        {"index.js": "x\n"},
    )
    _policy(root)
    _task(root)
    tree = ctx.mkdtemp("tree") / "node_modules"
    subprocess.run(["sh", "-c", f"mkdir -p {tree} && cd {tree} && {fill}"], check=True)
    reps = ctx.reps_or(7, 3)

    def fila_side() -> float:
        t = _task(root)["timings"]
        return t.get("prepare", 0.0) + t.get("diff", 0.0)

    def copy_side() -> float:
        dest = ctx.mkdtemp("copy") / "node_modules"
        t = time.perf_counter()
        subprocess.run(["cp", "-a", str(tree), str(dest)], check=True)
        dt = time.perf_counter() - t
        shutil.rmtree(dest.parent)
        return dt

    xs, ys = alternate(fila_side, copy_side, reps)
    ratio = median(xs) / median(ys)
    return Row(
        f"environment: later task's prepare+diff with a {MODULES}-file provided node_modules vs cp -a of it",
        round(median(xs), 3),
        round(median(ys), 3),
        "s",
        target=f"<= {TARGET_PROVIDED}x",
        ok=ratio <= TARGET_PROVIDED,
        ratio=round(ratio, 4),
        samples={"fila": xs, "copy": ys},
    )


def _first_builds(ctx: Ctx) -> list[Row]:
    import docker
    from tests.support.pkgindex import start_pkgindex
    from tests.upstreams import start_upstreams

    rows = []
    client = docker.from_env()
    with start_upstreams(client, ctx.mkdtemp("ups")) as ups, start_pkgindex(client, ups) as idx:
        net = {"allow": idx.allow(), "allow_private": [idx.subnet], "egress_network": idx.network}
        projects = {
            "python (pip install pytest)": (
                {
                    "image": BASE,
                    "env": idx.pip_env,
                    "setup": [{"name": "pip", "shell": "pip install --break-system-packages -q pytest"}],
                },
                {"test_a.py": "def test_a():\n    assert True\n"},
            ),
            "node (npm install uvu ms)": (
                {
                    "image": BASE,
                    "env": idx.npm_env,
                    "setup": [{"name": "npm", "shell": "npm install -q"}],
                    "inputs": ["package.json"],
                    "provided": ["node_modules"],
                },
                {
                    "package.json": json.dumps(
                        {
                            "name": "n",
                            "version": "1.0.0",
                            "dependencies": {"ms": "^2.1.3"},
                            "devDependencies": {"uvu": "^0.5.6"},
                        }
                    )
                },
            ),
        }
        for name, (decl, files) in projects.items():
            root = _root(ctx, "env-first", decl, files)
            _policy(root, **net)
            first = _task(root)
            second = _task(root)
            rows.append(
                Row(
                    f"environment: first build, {name}",
                    first["environment"]["setup_s"],
                    None,
                    "s",
                    note=f"task total {first['timings']['total']:.2f} s; the second task: "
                    f"{second['environment']['how']}, total {second['timings']['total']:.2f} s",
                )
            )
    return rows
