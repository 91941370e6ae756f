"""`fila env build|ls|rm|gc` below the CLI (docs/environments.md, "Commands"): one code path with
a task's (env/build.prepare), and the environments found by their images' labels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import InvalidInput, NotFound
from ..core.layout import Root
from ..core.models import Status
from ..queue import records
from ..queue.policy import load_policy
from ..sandbox.base import Backend
from . import declare
from . import engines as env_engines
from .build import KEY_LABEL, LABEL, Prepared, prepare, probe, remove_state, require_docker

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
    env = prepare(root, project, declared, pol, backend, job_id="env-build", progress=progress, force=force)
    from ..engines import get_engine

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
        out["key"], out["built"] = probe(root, project, declared, pol, backend)
    except NotFound as e:
        out["built"] = False
        out["problem"] = str(e)
    except InvalidInput as e:
        out["problem"] = str(e)
    return out


def listing(backend: Backend) -> list[dict[str, Any]]:
    """Every environment on this engine: its key, image, source, engine layers and volumes."""
    require_docker(backend)
    images = backend.labelled_images(LABEL)  # type: ignore[attr-defined]
    volumes = backend.labelled_volumes(KEY_LABEL)  # type: ignore[attr-defined]
    envs: dict[str, dict[str, Any]] = {}
    for info in images:
        key = info.labels.get(KEY_LABEL)
        if not key:
            continue
        e = envs.setdefault(key, {"key": key, "image": None, "source": None, "engines": [], "volumes": [],
                                  "size": 0})  # fmt: skip
        if info.labels.get(LABEL) == "engine":
            e["engines"].append(info.labels.get("fila.engine"))
        else:
            e["image"] = {"tag": info.tags[0] if info.tags else None, "id": info.id}
            e["source"] = info.labels.get("fila.env.source")
            e["size"] = info.size
    for v in volumes:
        key = (v.get("Labels") or {}).get(KEY_LABEL)
        if key in envs:
            envs[key]["volumes"].append(v["Name"])
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
    """Environments no task of this root that may still run or be reviewed names (queued, running,
    needs_review): removed. Returns the keys removed."""
    keep: set[str] = set()
    for rec in records.all_records(root):
        if rec.status in _LIVE and rec.environment is not None:
            keep.add(rec.environment.key)
    gone = []
    for e in listing(backend):
        if e["key"] not in keep:
            _remove(root, backend, e)
            gone.append(e["key"])
    return gone


def _remove(root: Root, backend: Backend, env: dict[str, Any]) -> list[str]:
    key = env["key"]
    removed = []
    for engine in env["engines"]:
        backend.remove_image(env_engines.tag_for(engine, key))
        removed.append(env_engines.tag_for(engine, key))
    if env["image"] is not None:
        backend.remove_image(env["image"]["tag"] or env["image"]["id"])
        removed.append(env["image"]["tag"] or env["image"]["id"])
    for v in env["volumes"]:
        if backend.remove_named_volume(v):  # type: ignore[attr-defined]
            removed.append(v)
    remove_state(root, key)
    return removed
