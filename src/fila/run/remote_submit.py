"""`fila submit --queue URL` (docs/scale-out.md): a task, or a compare group's members, checked
against the submitting root's policy and sent with its targets to the PostgreSQL queue in one
transaction (`submit --run` then waits for each member's record: docs/api.md).

The members are checked as the file queue's `submit_group` checks them (intake.check_group); the
targets are read and checked as a job directory's copy reads them (remote_inputs.pack), and sent
once for the whole group. The database refuses an id in use, for the whole group.
"""

from __future__ import annotations

from ..core.layout import Root
from ..core.models import Record, Task
from ..queue.pg.store import PgQueue
from ..queue.store import new_task_id
from ..review.groups import group_tasks
from .intake import check_group, check_task, pin_environment, root_tags
from .remote_inputs import pack


def submit_remote(
    root: Root,
    q: PgQueue,
    task: Task,
    *,
    engines: list[str] | None = None,
    models: dict[str, str] | None = None,
) -> list[Record]:
    """Queue `task` in the database `q` (with `engines`: one member per engine, ids GROUP.ENGINE,
    `models` an engine's own model) and return the queued records, in the members' order."""
    root.require()
    if engines:
        tasks = group_tasks(task, engines, models=models)
        check_group(root, tasks)  # the database refuses an id in use, in the same transaction
    else:
        tasks = [task.model_copy(update={"id": task.id or new_task_id()})]
    checked = check_task(root, tasks[0], tags_of=root_tags(root))  # as `submit` checks it
    packed = pack(root, tasks[0], checked)
    # What the runners' environment must be made of, computed once here: every member, on
    # whichever runner claims it, runs in that environment or refuses (docs/environments.md).
    digest = pin_environment(root, checked).environment_digest
    if digest is not None:
        tasks = [t.model_copy(update={"environment_digest": t.environment_digest or digest}) for t in tasks]
    return q.enqueue_group([(t.id, t) for t in tasks], inputs=packed.manifest, files=packed.files)
