"""`fila env build|ls|rm|gc` below the CLI (docs/environments.md, "Commands"): one code path with
a task's (env/build.prepare), and the environments found by their images' labels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import InvalidInput, InvalidPolicy, NotFound
from ..core.layout import Root
from ..core.models import Policy, Status
from ..egress import config as egress
from ..queue import records
from ..queue.policy import load_policy
from ..sandbox.base import Backend
from . import declare, hold
from . import engines as env_engines
from .build import (
    KEY_LABEL,
    LABEL,
    Prepared,
    named_volumes,
    partial_prefix,
    prepare,
    probe,
    remove_state,
    require_docker,
    state_dir,
    tag_for,
    valid_key,
)

# A task in one of these may still need its environment.
_LIVE = {Status.queued, Status.running, Status.needs_review}


def build(
    root: Root,
    project: Path,
    *,
    policy: str,
    explicit: str | None,
    backend: Backend,
    engines: list[str],
    force: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
) -> Prepared:
    """The project's environment made now (or found by its key), with `engines` layered on it."""
    require_docker(backend)
    pol, _ref = load_policy(root, policy)
    declared = declare.find(project, explicit)
    if declared is None:
        raise NotFound(
            f"{project} declares no environment",
            hint="add .devcontainer/devcontainer.json or fila-environment.json (docs/environments.md)",
        )
    for w in declared.warnings:
        progress(f"warning: {w}")
    from ..engines import get_engine

    # No task claims this build: its hold keeps its containers and networks from every sweep
    # while this process lives, and hands them over once it is gone (env/hold.py).
    with hold.hold(root) as held:
        env = prepare(
            root, project, declared, pol, backend, job_id=held.job_id, progress=progress, force=force
        )
        images = {}
        for name in engines:
            images[name] = env_engines.layer(backend, name, env.image, env.key, get_engine(name).image_tag(),
                                             progress=progress)  # fmt: skip
    env.record = env.record.model_copy(update={"engine_images": images})
    return env


def status(root: Root, project: Path, backend: Backend, policy: str = "default") -> dict[str, Any] | None:
    """The project's environment as `fila doctor` names it: where declared, its key, whether it is
    built (building nothing); None when the project declares none. An error is in `problem`."""
    try:
        declared = declare.find(project, None)
    except InvalidInput as e:
        return {"source": None, "problem": str(e)}
    if declared is None:
        return None
    out: dict[str, Any] = {"source": declared.source, "warnings": declared.warnings}
    try:
        require_docker(backend)
        pol, _ref = load_policy(root, policy)
        out["routes"] = route_credentials(pol)
        out["key"], out["built"] = probe(root, project, declared, pol, backend)
    except InvalidInput as e:
        out["problem"] = str(e)
    return out


def route_credentials(policy: Policy) -> dict[str, str | None]:
    """Each setup route's credential problem (None: readable), reading no value: a missing one
    fails the next setup, never a task on a built environment."""
    out: dict[str, str | None] = {}
    for name, route in policy.environment.routes.items():
        try:
            egress.check_credential(f"environment.routes.{name}", route)
            out[name] = None
        except InvalidPolicy as e:
            out[name] = e.message
    return out


def listing(backend: Backend) -> list[dict[str, Any]]:
    """Every environment on this engine: its key, image, source, engine layers and volumes.

    Only what fila made is taken: a well-formed key, an image tagged as fila tags it for that key
    (a project's Dockerfile can write any label on its base: the base is never an environment),
    and `named`, the volumes its image's label names (or a setup's in progress: its partial)."""
    require_docker(backend)
    images = backend.labelled_images(LABEL)  # type: ignore[attr-defined]
    volumes = backend.labelled_volumes(KEY_LABEL)  # type: ignore[attr-defined]
    envs: dict[str, dict[str, Any]] = {}

    def entry(key: str) -> dict[str, Any]:
        return envs.setdefault(key, {"key": key, "image": None, "source": None, "engines": [], "volumes": [],
                                     "named": [], "size": 0})  # fmt: skip

    for info in images:
        key, role = info.labels.get(KEY_LABEL), info.labels.get(LABEL)
        if not valid_key(key) or role == "base":
            continue
        engine = info.labels.get("fila.engine") or ""
        if role == "engine" and env_engines.tag_for(engine, key) in info.tags:
            entry(key)["engines"].append(engine)
        elif role == "1" and tag_for(key) in info.tags:
            e = entry(key)
            e["image"] = {"tag": tag_for(key), "id": info.id}
            e["source"] = info.labels.get("fila.env.source")
            e["size"] = info.size
            e["named"] += named_volumes(info.labels, key)
        elif role == "1" and any(t.startswith(partial_prefix(key)) for t in info.tags):
            entry(key)["named"] += named_volumes(info.labels, key)
    for v in volumes:
        key = (v.get("Labels") or {}).get(KEY_LABEL)
        if valid_key(key):
            entry(key)["volumes"].append(v["Name"])
    return sorted(envs.values(), key=lambda e: e["key"])


def remove(root: Root, backend: Backend, prefix: str) -> list[str]:
    """The environment whose key starts with `prefix`: its images, engine layers and volumes."""
    if len(prefix) < 6:
        raise InvalidInput(
            f"key prefix {prefix!r} is too short", hint="give at least 6 characters of the key"
        )
    found = [e for e in listing(backend) if e["key"].startswith(prefix)]
    if not found:
        raise NotFound(f"no environment's key starts with {prefix!r}", hint="`fila env ls` lists them")
    if len(found) > 1:
        raise InvalidInput(
            f"{len(found)} environments' keys start with {prefix!r}", hint="give more of the key"
        )
    return _remove(root, backend, found[0])


def gc(root: Root, backend: Backend) -> list[str]:
    """This root's environments (those with a state directory under sandbox/envs/: the daemon may
    be shared with other roots) that no task that may still run or be reviewed names (queued,
    running, needs_review): removed; a kept one's volumes that its image does not name (a setup
    of the same key that lost the race) too. Returns the keys removed."""
    keep: set[str] = set()
    for rec in records.all_records(root):
        if rec.status in _LIVE and rec.environment is not None:
            keep.add(rec.environment.key)
    gone = []
    for e in listing(backend):
        if not state_dir(root, e["key"]).is_dir():
            continue
        if e["key"] not in keep:
            _remove(root, backend, e)
            gone.append(e["key"])
        else:
            for v in set(e["volumes"]) - set(e["named"]):
                backend.remove_named_volume(v)  # type: ignore[attr-defined]
    return gone


def _remove(root: Root, backend: Backend, env: dict[str, Any]) -> list[str]:
    key = env["key"]
    removed = []
    for engine in env["engines"]:
        backend.remove_image(env_engines.tag_for(engine, key))
        removed.append(env_engines.tag_for(engine, key))
    if env["image"] is not None:
        backend.remove_image(env["image"]["tag"])
        removed.append(env["image"]["tag"])
    for v in env["volumes"]:
        if backend.remove_named_volume(v):  # type: ignore[attr-defined]
            removed.append(v)
    remove_state(root, key)
    return removed
