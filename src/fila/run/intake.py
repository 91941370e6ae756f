"""Task intake (docs/architecture.md, "The cycle", steps 1-2): an untrusted task file parsed and
checked against its policy before any container exists, and `submit` (one task, or a compare
group's members) queueing it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import untrusted
from ..core.errors import DuplicateId, InvalidTaskFile, TargetError, UnknownEngine
from ..core.layout import Root
from ..core.models import EnvironmentRecord, Policy, PolicyRef, Record, Task
from ..core.mounts import ProvidedVolume
from ..egress import config as egress
from ..engines import Engine, get_engine
from ..queue import store as queue
from ..queue.policy import (
    Effective,
    image_allowed,
    load_json,
    load_policy,
    narrow,
    policy_path,
    validate_document,
)
from ..workspace import jobdir


@dataclass(frozen=True)
class Checked:
    task: Task
    engine: Engine
    policy: Policy
    policy_ref: PolicyRef
    effective: Effective
    project: Path
    targets: list[str]
    image: str
    # The engines run in turn on quota (the task's own first) and the image of each.
    chain: tuple[tuple[str, str], ...] = ()
    # A project environment (run/environment.py): the check's image, the provided volumes, and
    # what the record says of it; None without one.
    check_image: str | None = None
    volumes: tuple[ProvidedVolume, ...] = ()
    environment: EnvironmentRecord | None = None


def parse_task_file(path: Path, *, expected_id: str | None = None) -> Task:
    """An untrusted task file (fila/in/, `fila submit FILE`): never blocks, never follows a link."""
    return parse_task_data(load_json(path, "task"), path=path, expected_id=expected_id)


def parse_task_bytes(raw: bytes, *, source: str) -> Task:
    """An untrusted task read from a stream (`fila submit -`), capped by the caller."""
    if len(raw) > untrusted.MAX_TASK_BYTES:
        raise InvalidTaskFile(f"the task is above the {untrusted.MAX_TASK_BYTES}-byte limit", path=source)
    return parse_task_data(
        untrusted.parse_json(raw, kind="task", error=InvalidTaskFile, path=source), path=source
    )


def parse_task_data(data: Any, *, path: Path | str, expected_id: str | None = None) -> Task:
    validate_document("task", data, path=path)  # the schema, then the model: names the field
    task = Task.model_validate(data)
    check_names(task, path=path)
    if expected_id and task.id and task.id != expected_id:
        raise InvalidTaskFile(
            f"id {task.id!r} differs from the file name's {expected_id!r}", field="id", path=path
        )
    return task


def check_names(task: Task, *, path: Path | str | None = None) -> None:
    """Names and paths a task hands to file names, argv and terminals hold no control or bidi
    characters (prompt and command may: they are text, quoted where shown)."""
    untrusted.check_names(
        [
            ("id", task.id),
            ("engine", task.engine),
            ("model", task.model),
            ("policy", task.policy),
            ("project", task.project),
            ("image", task.image),
            *((f"targets.{i}", t) for i, t in enumerate(task.targets)),
            *((f"fallback.{i}", f) for i, f in enumerate(task.fallback or [])),
            ("group", task.group),
            ("submitter", task.submitter),
        ],
        error=InvalidTaskFile,
        path=path,
    )


IMAGE_ID_RE = re.compile(r"(sha256:)?[0-9a-f]{12,64}")


def fallback_chain(task: Task, policy: Policy) -> list[tuple[str, str]]:
    """(field, engine) in the order they run on quota: the task's engine, then its `fallback`, or
    the policy's when the task names none (an explicit [] means none). An engine named twice runs
    once: it would only report quota again."""
    own = task.fallback is not None
    rest = task.fallback if own else policy.fallback
    chain = [("engine", task.engine)]
    for i, name in enumerate(rest or []):
        if name not in (n for _f, n in chain):
            chain.append((f"fallback.{i}" if own else f"policy {task.policy!r} fallback.{i}", name))
    return chain


def _engine_for(field: str, name: str) -> Engine:
    try:
        return get_engine(name)
    except UnknownEngine as e:  # the field, so a fallback's typo is not blamed on `engine`
        raise InvalidTaskFile(e.message, field=field, hint=e.hint) from None


def check_task(root: Root, task: Task, *, tags_of: Callable[[str], list[str]] | None = None) -> Checked:
    """Everything that can be known to be wrong before a container exists. `tags_of` (Docker)
    resolves a pinned image the policy's patterns do not name literally (an image id) to its tags."""
    check_names(task)
    if task.image is not None and not untrusted.image_reference(task.image):
        raise InvalidTaskFile(
            f"{task.image!r} is not a Docker image reference",
            field="image",
            hint="name[:tag][@sha256:digest], names in lowercase letters, digits and . _ -",
        )
    engine = _engine_for("engine", task.engine)
    engine.config(task)
    policy, ref = load_policy(root, task.policy)
    size = len(task.prompt.encode())
    if size > policy.max_prompt_bytes:
        raise InvalidTaskFile(
            f"the prompt is {size} bytes, above policy {task.policy!r}'s max_prompt_bytes "
            f"{policy.max_prompt_bytes}",
            field="prompt",
            hint="shorten the prompt (put long context in a target file), or use a policy with a larger cap",
        )
    eff = narrow(policy, task, name=task.policy)
    project = jobdir.project_of(root, task, policy)
    if not project.is_dir():
        raise TargetError("project directory does not exist", path=project)
    targets = jobdir.resolve_targets(root, project, task.targets, policy)
    image = task.image or engine.image_tag()
    allowed = f"allowed: {', '.join(policy.images) or 'none'}"
    # Only an image id is judged by its tags: a name is judged as written, never by what it points to.
    by_id = bool(task.image and IMAGE_ID_RE.fullmatch(task.image))
    if not image_allowed(policy, image) and not (
        by_id and tags_of and image_allowed(policy, image, tags_of(image))
    ):
        raise InvalidTaskFile(
            f"image {image!r} is not allowed by policy {task.policy!r} ({allowed})",
            field="image" if task.image else "engine",
            hint="pin an image the policy's `images` patterns match (an image id counts by its tags)",
        )
    chain = [(task.engine, image)]
    for field, name in fallback_chain(task, policy)[1:]:
        fb = _engine_for(field, name)
        fb.config(task)
        # A pinned image is the task engine's: each fallback engine runs its own image.
        if not image_allowed(policy, fb.image_tag()):
            raise InvalidTaskFile(
                f"fallback engine {name!r} runs image {fb.image_tag()!r}, which policy {task.policy!r} "
                f"does not allow ({allowed})",
                field=field,
            )
        chain.append((name, fb.image_tag()))
    _learns_alone(task, policy, chain)
    stray = sorted(set(task.options or {}) - {n for n, _i in chain})
    if stray:  # an option for an engine that never runs would be ignored in silence
        raise InvalidTaskFile(
            f"options.{stray[0]}: {stray[0]!r} is not an engine this task runs "
            f"({', '.join(n for n, _i in chain)})",
            field=f"options.{stray[0]}",
        )
    policy = _routes_checked(root, task, policy)
    if task.check and not image_allowed(policy, get_engine("shell").image_tag()):
        raise InvalidTaskFile(
            f"the check runs in {get_engine('shell').image_tag()!r}, which policy {task.policy!r} "
            f"does not allow ({allowed})",
            field="check",
        )
    return Checked(task, engine, policy, ref, eff, project, targets, image, tuple(chain))


def _learns_alone(task: Task, policy: Policy, chain: list[tuple[str, str]]) -> None:
    """A learning policy (egress.learn) runs one engine per task: what a run learned is that
    engine's, and `fila policy suggest` reads one run's hosts (README, "Learn, then lock")."""
    if policy.egress is None or not policy.egress.learn:
        return
    if task.group is not None:
        raise InvalidTaskFile(
            f"policy {task.policy!r} is learning (egress.learn): a compare group runs several engines, "
            "and one engine learns at a time",
            field="group",
            hint="learn with one engine, lock with `fila policy suggest`, then compare under the new policy",
        )
    if len(chain) > 1:
        raise InvalidTaskFile(
            f"policy {task.policy!r} is learning (egress.learn): a fallback chain "
            f"({', '.join(n for n, _i in chain)}) runs several engines, and one engine learns at a time",
            field="fallback",
            hint='set "fallback": [] in the task, or learn under a policy without fallback',
        )


def chain_routes(task: Task, policy: Policy) -> list[str]:
    """The model routes the task's engines (its fallbacks too) use: each engine's own, and every
    route of the policy for an engine whose command may call any (shell)."""
    given = list(policy.egress.routes) if policy.egress else []
    out: dict[str, None] = {}
    for _field, name in fallback_chain(task, policy):
        eng = get_engine(name)
        out.update(dict.fromkeys(given if eng.any_route else eng.routes))
    return list(out)


def _routes_checked(root: Root, task: Task, policy: Policy) -> Policy:
    """Every engine of the chain has its model routes in the policy, and each route a task's
    engine uses has a readable credential (README, "Network allowlist"); the policy the job runs
    under keeps only those routes, so its gateway holds no other key."""
    given = policy.egress.routes if policy.network == "allowlist" and policy.egress else {}
    for field, name in fallback_chain(task, policy):
        missing = [r for r in get_engine(name).routes if r not in given]
        if not missing:
            continue
        route = missing[0]
        var = egress.KNOWN_ROUTES[route].key_env
        shipped = (
            f"use the shipped policy {route!r} (--policy {route}: network allowlist, the {route} route, "
            f"the key from {var}; `fila init` writes it to policies/{route}.json)"
        )
        if policy.network != "allowlist":
            raise InvalidTaskFile(
                f"engine {name!r} reaches its model through the gateway's {route!r} route, and policy "
                f"{task.policy!r} has network {policy.network!r}: no gateway, no route",
                field=field,
                hint=shipped,
            )
        raise InvalidTaskFile(
            f"engine {name!r} talks to model route {route!r}, and policy {task.policy!r} "
            f"has no egress.routes.{route} (no credential for it)",
            field=field,
            hint=f"{shipped}, or add egress.routes.{route} with its credential to policy {task.policy!r}",
        )
    if policy.network != "allowlist":
        return policy
    used = chain_routes(task, policy)
    egress.check_credentials(policy, used, path=policy_path(root, task.policy))
    return egress.only_routes(policy, used)


def root_tags(root: Root) -> Callable[[str], list[str]]:
    """The local tags of an image (by id or name), for the policy's image patterns, as the queue
    root's own backend (its fila/config.json, or FILA_BACKEND) has them; none when not built."""

    def tags_of(image: str) -> list[str]:
        from ..sandbox import get_backend, root_backend

        backend = get_backend(root_backend(root))
        try:
            return backend.tags(image)
        finally:
            backend.close()

    return tags_of


def submit(root: Root, task: Task) -> Record:
    root.require()
    # Through the reader a claim uses: a task built from options (a NUL in --prompt) is refused
    # here, not queued and then refused at claim.
    task = parse_task_bytes(queue.task_json(task).encode(), source="the submitted task")
    task = pin_environment(root, check_task(root, task, tags_of=root_tags(root)))
    return queue.enqueue(root, task.id or queue.new_task_id(), task)


def pin_environment(root: Root, checked: Checked) -> Task:
    """The checked task with its environment's content digest where this host can tell (envpin)."""
    from .envpin import pin

    return pin(root, checked.task, checked.project, checked.policy)


def check_group(
    root: Root, tasks: list[Task], *, in_use: Callable[[str], str | None] | None = None
) -> list[Checked]:
    """A compare group's members (review/groups.group_tasks) before any is queued: every one
    checked against `root`'s policy (engine options, image, policy) and, with `in_use` (where a
    queue holds an id, or None), its id free. Both queues' submits use it (docs/scale-out.md)."""
    out = []
    for t in tasks:
        assert t.id is not None
        where = in_use(t.id) if in_use else None
        if where:
            raise DuplicateId(f"task id {t.id!r} exists already ({where})", task_id=t.id,
                              hint="choose another group id (--id)")  # fmt: skip
        out.append(check_task(root, Task.model_validate(t.model_dump())))
    return out


def submit_group(root: Root, tasks: list[Task]) -> list[Record]:
    """Queue a compare group's members: every member is checked and every id is free
    (check_group) before any is queued."""
    root.require()
    checked = check_group(root, tasks, in_use=lambda tid: queue.id_in_use(root, tid))
    # One digest for the whole group, computed once: its members compare engines in one environment.
    digest = pin_environment(root, checked[0]).environment_digest if checked else None
    pinned = [t.model_copy(update={"environment_digest": t.environment_digest or digest}) for t in tasks]
    return [submit(root, t) for t in pinned]
