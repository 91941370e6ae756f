"""Every error fila raises on purpose, in one tree.

The CLI catches `FilaError` in one place (`fila.cli._Group.invoke`), prints `str(err)` (what failed, where,
which limit) followed by `err.hint` (what to do next), and exits with `err.exit_code`. Anything
else that escapes is a bug and is shown with its traceback.

    FilaError                      exit 1
    ├── InvalidInput               exit 2   the user's input is wrong; nothing was changed
    │   ├── InvalidTaskFile        malformed JSON or a schema violation (names the field)
    │   ├── InvalidPolicy          a policy file that does not validate, or a task that widens it
    │   ├── UnknownEngine          lists the valid engine names
    │   ├── UnknownPolicy          lists the policies that exist
    │   ├── InvalidId              task id outside [A-Za-z0-9._-]{1,128}
    │   ├── TargetError            a target that is missing, outside the project or denied
    │   └── InvalidEnvironment     a project environment's declaration fila refuses (names the key)
    ├── InfraError                 exit 3   Docker or the host failed; the task is kept queued
    │   ├── EngineUnavailable      the container engine (Docker, Podman) does not answer
    │   └── ImageMissing           the engine's image is not built (hint: fila images build)
    ├── Refused                    exit 4   the request conflicts with the queue's state
    │   ├── DuplicateId            an id that exists anywhere in the queue
    │   ├── InvalidTransition      a status change the state machine does not allow
    │   ├── ApplyRefused           apply would not land exactly what was reviewed
    │   ├── BreakerTripped         the worker's circuit breaker is open (exit 6)
    │   └── RecordMismatch         a record whose id is not its file's (also a ValueError)
    ├── NotFound                   exit 5   no task, job or record with that id
    ├── LimitExceeded              exit 1   what an engine left breaks a policy limit (size, count)
    ├── TimedOut                   exit 1   a wait ran out of time; the task is still queued or running
    └── TreeNotRemoved             exit 1   a job directory rm cannot remove (also an OSError)

Messages say what failed and where; `hint` says what to do next. Keep both short and concrete.
"""

from __future__ import annotations

from pathlib import Path


class FilaError(Exception):
    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        task_id: str | None = None,
        path: Path | str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.task_id = task_id
        self.path = str(path) if path is not None else None

    def __str__(self) -> str:
        where = []
        if self.task_id:
            where.append(f"task {self.task_id}")
        if self.path:
            where.append(self.path)
        return f"{self.message}" + (f" ({', '.join(where)})" if where else "")

    def to_dict(self) -> dict[str, str | int | None]:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "hint": self.hint,
            "task_id": self.task_id,
            "path": self.path,
            "exit_code": self.exit_code,
        }


class InvalidInput(FilaError):
    exit_code = 2


class InvalidTaskFile(InvalidInput):
    def __init__(self, message: str, *, field: str | None = None, **kw: object) -> None:
        self.field = field
        prefix = f"field '{field}': " if field else ""
        super().__init__(prefix + message, **kw)  # type: ignore[arg-type]


class InvalidPolicy(InvalidInput):
    pass


class UnknownEngine(InvalidInput):
    pass


class UnknownPolicy(InvalidInput):
    pass


class InvalidId(InvalidInput):
    pass


class TargetError(InvalidInput):
    pass


class InvalidEnvironment(InvalidInput):
    """A project environment's declaration (devcontainer.json, fila-environment.json) that fila
    cannot read or will not obey: the message names the key or path and why (docs/environments.md)."""


class InfraError(FilaError):
    exit_code = 3


class EngineUnavailable(InfraError):
    pass


class ImageMissing(InfraError):
    pass


class HostLacks(InfraError):
    """A runner's host lacks what a task it claimed needs (`what`: "policy" or "engine", and its
    `name`): its policy file as the host has it, a runtime, a route's credential, its engine's
    image. The host's, not the task's: the task goes back with its tries, and the runner claims
    that policy or engine no more (docs/scale-out.md)."""

    def __init__(self, what: str, name: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.what, self.name = what, name


class Refused(FilaError):
    exit_code = 4


class DuplicateId(Refused):
    pass


class InvalidTransition(Refused):
    pass


class ApplyRefused(Refused):
    pass


class CredentialInDiff(ApplyRefused):
    """The diff held a credential fila knows (replaced by a marker); applying needs the person's
    explicit word (--allow-credential)."""


class BreakerTripped(Refused):
    exit_code = 6


class RecordMismatch(Refused, ValueError):
    """A record whose `id` is not the task its file name says (another task's record copied or
    restored over it). A ValueError too, like a record that does not parse: every reader that
    passes over an unreadable record passes over this one, and nothing acts on it."""


class NotFound(FilaError):
    exit_code = 5


class LimitExceeded(FilaError):
    pass


class TimedOut(FilaError):
    """A wait for a task's record (the API's `wait`, the MCP server's wait tool) ran out of time:
    nothing changed, the task is still queued or running and may be waited for again."""


class TreeNotRemoved(FilaError, OSError):
    """A directory fila must remove (a job's previous copy or overlay scratch) that rm cannot
    remove: the task's own failure (an OSError, so its record says infra and the run goes on),
    with rm's stderr and what to do, never a traceback."""


# Exit codes of `fila run --once` and `fila worker --once`, documented in --help and the README.
EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_INVALID = 2
EXIT_DOCKER = 3
EXIT_REFUSED = 4
EXIT_NOT_FOUND = 5
EXIT_BREAKER = 6
EXIT_INTERRUPTED = 130
