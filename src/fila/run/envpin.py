"""What a submitted task's environment must be made of (docs/environments.md, "Many hosts"):
`fila submit` pins the content digest of the project's environment on the submitting host in the
task, so every runner that claims it, and every member of its group, sets up that environment or
refuses the task (env/build.prepare's `expect_digest`)."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import FilaError
from ..core.layout import Root
from ..core.models import Policy, Task
from ..env import declare


def pin(root: Root, task: Task, project: Path, policy: Policy) -> Task:
    """`task` with Task.environment_digest, the content digest (env/key.content: the base image's
    id, the declaration, the inputs) of its project's environment on this host. Nothing is built
    and no container starts; the container client is opened only for a project that declares an
    environment. The task is returned unchanged when this host cannot tell (no Docker backend, a
    base image it lacks, a declaration the runner will refuse in the record): the runner's own
    digest is recorded then."""
    if task.environment_digest is not None or task.environment == "none":
        return task
    try:
        declared = declare.find(project, task.environment)
        if declared is None:
            return task
        from ..env.build import digest_of
        from ..sandbox import get_backend, root_backend

        digest = digest_of(root, project, declared, policy, get_backend(root_backend(root)))
    except (FilaError, OSError):  # no engine here, or it failed to answer: the runner tells
        return task
    return task.model_copy(update={"environment_digest": digest})
