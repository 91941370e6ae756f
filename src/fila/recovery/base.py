"""What every step of a recovery pass shares: the report it adds to, the container engine it
may ask (connected on first use), and the one transition it makes out of `running`
(docs/architecture.md, the queue's contract)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..core import fsutil
from ..core.errors import EngineUnavailable, InfraError
from ..core.layout import Root
from ..core.models import Record, Status, now_iso
from ..queue import store as queue

if TYPE_CHECKING:
    from ..sandbox import Backend

S = Status


@dataclass
class Action:
    task_id: str | None
    action: str
    detail: str


@dataclass
class Report:
    actions: list[Action] = field(default_factory=list)
    containers_removed: list[str] = field(default_factory=list)
    docker: str = "not needed"  # the container engine's state (the key predates other backends)
    backend: str = ""  # the backend that answered
    skipped: bool = False

    def add(self, root: Root, task_id: str | None, action: str, detail: str, **data: Any) -> None:
        self.actions.append(Action(task_id, action, detail))
        if task_id is not None:
            queue.log_event(root, task_id, "recovered", action=action, detail=detail, **data)
        with contextlib.suppress(OSError):
            fsutil.append_line(
                root.state_dir / "recovery.events.jsonl",
                json.dumps(
                    {
                        "at": now_iso(),
                        "task": task_id,
                        "action": action,
                        "detail": detail,
                    },
                    default=str,
                ),
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "actions": [asdict(a) for a in self.actions],
            "containers_removed": self.containers_removed,
            "docker": self.docker,
            "backend": self.backend,
            "skipped": self.skipped,
        }


class Engine:
    """The backend, connected on first use; when its engine does not answer, recovery goes on
    without it (and decides nothing that needs it)."""

    def __init__(self, root: Root, backend: Backend | None, enabled: bool) -> None:
        self.root, self.backend, self.enabled = root, backend, enabled
        self.owned = backend is None
        self.error: str | None = None if enabled else "skipped"
        self.used = False

    def get(self) -> Backend | None:
        if self.error is not None:
            return None
        if self.backend is None:
            from ..sandbox import get_backend, root_backend

            self.backend = get_backend(root_backend(self.root))
        if not self.used:
            try:
                self.backend.ping()
            except EngineUnavailable as e:
                self.error = f"unavailable: {e.message}"
                return None
            self.used = True
        return self.backend

    def close(self) -> None:
        if self.owned and self.backend is not None:
            self.backend.close()

    def job_containers(self, root: Root, tid: str) -> tuple[list[str], str, bool]:
        """Describe and remove the job's containers: (ids removed, what was found, gone). `gone`
        is True only when the engine answered and no container of the job is left: until then a
        frozen worker may still start its engine, so nothing may be decided."""
        backend = self.get()
        if backend is None:
            why = f"the container engine did not answer, so the container could not be checked ({self.error})"
            return [], why, False
        try:
            seen, removed = [], []
            for box in backend.find(job_id=tid, root=str(root.path)):
                seen.append(box.describe())
                if backend.remove(box):
                    removed.append(box.id)
        except InfraError as e:
            return (
                [],
                f"{backend.name} failed while checking or removing the container: {e}",
                False,
            )
        if not seen:
            return [], "no container of this job was found", True
        return removed, "container " + "; ".join(seen) + " was found and removed", True


def settle(root: Root, tid: str, cur: Record, to: Status, **changes: Any) -> None:
    """The one transition recovery makes out of `running` (under the caller's record lock): to
    needs_human, failed or queued, closing the attempt as lost."""
    queue.transition_locked(
        root,
        tid,
        cur,
        to,
        expect={S.running},
        event="recovered",
        outcome="lost",
        changes=changes,
    )
