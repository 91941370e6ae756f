"""A claimed task's project environment (docs/environments.md): found where the project declares
it, made or found by its key (env/build.py), each engine of the chain layered on it, and the
task's check moved onto it. Without a declaration (or with `"environment": "none"`) the task
runs on its engines' own images, as before."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..core.errors import InvalidInput, InvalidTaskFile
from ..core.models import EnvironmentRecord
from ..env import declare
from ..env import engines as env_engines
from ..env.build import EnvironmentFailed, prepare
from ..env.spec import Declared

if TYPE_CHECKING:
    from .claimed import JobRun
    from .intake import Checked


def apply(run: JobRun, checked: Checked) -> Checked:
    """`checked` with its environment, or unchanged when the project declares none. Raises
    EnvironmentFailed (the setup failed: no engine starts) or InvalidInput (the declaration)."""
    task = checked.task
    declared = declare.find(checked.project, task.environment)
    if declared is None:
        return checked
    if task.image is not None:
        raise InvalidTaskFile(
            f"the task pins image {task.image!r} and the project declares an environment "
            f"({declared.source}): one or the other",
            field="image",
            hint='set "environment": "none" to run on the pinned image',
        )
    try:
        env = prepare(
            run.root, checked.project, declared, checked.policy, run.backend,
            job_id=run.tid, progress=run.progress, heartbeat=run.heartbeat,
            expect_digest=task.environment_digest,
        )  # fmt: skip
        chain = []
        images = {}
        for name, image in checked.chain:
            ref = env_engines.layer(run.backend, name, env.image, env.key, image, progress=run.progress)
            chain.append((name, ref.tag))
            images[name] = ref
    except EnvironmentFailed:
        raise
    except InvalidInput as e:  # the declaration or a layer: the environment's own failure
        raise EnvironmentFailed(str(e), record=_declared_record(declared), hint=e.hint) from e
    provided = declare.deny_rules(declared.spec.provided)
    policy = checked.policy.model_copy(update={"deny": [*checked.policy.deny, *provided]})
    record = env.record.model_copy(update={"engine_images": images})
    return dataclasses.replace(
        checked,
        policy=policy,
        chain=tuple(chain),
        image=chain[0][1],
        check_image=env.image.tag,
        volumes=tuple(env.volumes),
        environment=record,
    )


def _declared_record(declared: Declared) -> EnvironmentRecord:
    return EnvironmentRecord(
        key="", source=declared.source, form=declared.form, name=declared.spec.name, how="failed",
        warnings=list(declared.warnings),
    )  # fmt: skip
