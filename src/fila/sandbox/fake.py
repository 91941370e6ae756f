"""FakeBackend: a `Backend` without containers, for tests and benchmarks. NOT A SANDBOX.

Like httpx's MockTransport it is real, documented code shipped in the package, so the cycle, the
worker, recovery and the queue can be exercised and measured without Docker
(docs/architecture.md, "Layers"). It is chosen only explicitly: `FILA_BACKEND=fake` for one
command, or an instance passed to `run_one`, `Worker` or `recover`; a queue root's
fila/config.json cannot name it. Its name in records and errors is `fake`.

A job either runs its command on the host, or follows a script:

- The command: `spec.argv` in a subprocess of its own session, with `spec.env` only (no host
  variable leaks in), `/job` in argv and env mapped to the job directory (the shell engine's
  `cd /job/work; sh -c CMD` runs in work/), HOME a scratch directory removed afterwards. The
  host's timeout is enforced like the container backends': SIGTERM to the process group, SIGKILL
  after the policy's grace. Both streams go to the log as they come, redacted and capped at
  max_log_bytes, and apart to `RunOutput`; an exit by signal N is reported as 128+N, as a
  container's is. Nothing confines the command: it runs with fila's own uid, files and network.
- A script (`Act`, per job id or from a function of the spec): an exit code, output, how long
  the "engine" runs, files it writes into work/, a stall (only the timeout or a removal ends it),
  and failures: an error raised before the box exists, once it started, or at its removal (the
  box then stays for recovery to find). `down` makes ping, run, find and remove raise
  EngineUnavailable, as a daemon that does not answer does; `stuck` makes every removal fail;
  `leave` plants the box a killed worker leaves; `removed` and `specs` say what happened.

sandbox/fake_job.py plays both; this module keeps the boxes, the images and the Backend seam.

Boxes (the fake's containers) are files, one JSON per box under `state` (FILA_FAKE_DIR, else
<tmp>/fila-fake-<uid>), with fila's labels: a worker killed mid-run leaves its box and its
command's process for another process's `fila recover` to find by label and remove (the process
group is killed), exactly what the crash tests need of a container engine. A box records the
process it stands for (pid and start time, so a reused pid is never killed); a box whose process
is gone reads as exited. Each start is also a line of `state/events`, as each container start is
an event of Docker's stream: tests count runs there, independently of fila's records.

Images are a fixed set of tags (every engine's `fila/<engine>:latest` and the gateway's), each
with a stable made-up id; nothing is built or pulled. `network: allowlist` is refused before
anything runs (no job network, no gateway); none of the policy's limits is enforced, and the
record of every command run says so in its warnings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..core.errors import EngineUnavailable, ImageMissing, InfraError, InvalidPolicy
from ..core.fsutil import file_lock
from ..core.models import ImageRef, Policy, now_iso
from .base import (
    JOB_LABEL,
    LABEL,
    ROOT_LABEL,
    WORKER_LABEL,
    Backend,
    Box,
    ImageInfo,
    Removal,
    RunResult,
    RunSpec,
    call_heartbeat,
    container_name,
    note_left,
)
from .fake_job import Act, Capture, Command, Script, Scripted, alive, start_time

__all__ = ["NOT_A_SANDBOX", "Act", "FakeBackend", "Script"]

STATE_ENV = "FILA_FAKE_DIR"
EVENTS = "events"  # one line per box started (`FakeBackend.events`)
NOT_A_SANDBOX = "not a sandbox: the fake backend ran the command on the host, without a container or limits"
_KILL_WAIT_S = 30.0
KEPT = 100  # specs and removed ids a backend keeps for the tests to read (the newest)


class FakeBackend(Backend):
    """Runs jobs without containers (module docstring): commands on the host, or a script. Not a
    sandbox; thread-safe; boxes on disk under `state`, shared by every process that names it."""

    name = "fake"
    allowlist = False

    def __init__(
        self,
        state: Path | None = None,
        *,
        script: Script | None = None,
        images: Mapping[str, str] | None = None,
        down: str | None = None,
        unenforceable: list[str] | None = None,
    ) -> None:
        default = Path(tempfile.gettempdir()) / f"fila-fake-{os.getuid()}"
        self.state = Path(state or os.environ.get(STATE_ENV) or default)
        self.script = script
        self.down = down  # why the "engine" does not answer; None: it does
        self.stuck: str | None = None  # why every removal fails (InfraError); None: they work
        # What the tests read, the newest KEPT of each: a long-running worker on this backend keeps
        # nothing per task, as on Docker's.
        self.removed: list[str] = []  # the ids remove() removed, in order
        self._images = dict(images) if images is not None else _default_images()
        self._unenforceable = list(unenforceable or [])
        self._lock = threading.Lock()
        self.specs: list[RunSpec] = []  # the specs run() was given, in order

    # -- the engine answers, or not ---------------------------------------------------------------

    def _answer(self) -> None:
        if self.down is not None:
            raise EngineUnavailable(
                f"the fake backend does not answer: {self.down}",
                hint="the fake backend was told to be down (FakeBackend.down)",
            )

    def ping(self) -> None:
        self._answer()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": "fake", "state": str(self.state), "note": NOT_A_SANDBOX}

    # -- policies ---------------------------------------------------------------------------------

    def unenforceable(self, policy: Policy) -> list[str]:
        """What the constructor was told (default none): choosing the fake waives every limit."""
        return list(self._unenforceable)

    def why_unenforceable(self) -> str:
        return "the fake backend was told it cannot (FakeBackend(unenforceable=...))"

    def check(self, policy: Policy, *, job_id: str | None = None) -> list[str]:
        if policy.network == "allowlist":
            raise InvalidPolicy(
                "the fake backend does not run network allowlist (it has no job network and no "
                "gateway); the job was not started",
                hint="use network none with FILA_BACKEND=fake, or FILA_BACKEND=docker for allowlist",
                task_id=job_id,
            )
        return super().check(policy, job_id=job_id)

    # -- boxes --------------------------------------------------------------------------------------

    def _path(self, box_id: str) -> Path:
        return self.state / f"{box_id}.json"

    def _save(self, data: dict[str, Any]) -> None:
        """Written whole (temp file, rename) and never fsynced: a box stands for a process, and
        no process outlives a reboot."""
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.state / f".{data['id']}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path(data["id"]))

    @contextlib.contextmanager
    def _boxes_locked(self) -> Iterator[None]:
        """A box's change of state and its removal exclude each other (threads and processes
        alike): a removal between a run's look and its write would otherwise be undone by the
        write, and the box's process would run on as if nobody had removed it."""
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        with file_lock(self.state / ".boxes.lock", mode=0o600):
            yield

    def _update(self, data: dict[str, Any]) -> bool:
        """The box's new state, written only while the box is still there. False when it was
        removed (a container engine refuses to start, or to report on, a removed container)."""
        with self._boxes_locked():
            if not self._path(data["id"]).exists():
                return False
            self._save(data)
            return True

    def _event(self, kind: str, box: dict[str, Any]) -> None:
        """One line appended to the state's event log, as Docker's event stream has one per
        container start: a test counts runs from it, not from fila's records. One write() of
        less than PIPE_BUF with O_APPEND: lines of several processes never interleave."""
        line = json.dumps({"event": kind, "job": box["labels"][JOB_LABEL], "box": box["id"]}) + "\n"
        fd = os.open(self.state / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self) -> list[dict[str, str]]:
        """Every event of this state directory (all processes that shared it), oldest first."""
        try:
            text = (self.state / EVENTS).read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines()]

    def _load(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # removed meanwhile, or never a box
        return data if isinstance(data, dict) else None

    def _box(self, data: dict[str, Any]) -> Box:
        status, code = data["status"], data.get("exit_code")
        if status == "running" and not alive(data.get("pid"), data.get("pid_started")):
            status, code = "exited", None  # its process (or the process playing it) is gone
        return Box(id=data["id"], name=data["name"], status=status, labels=data["labels"], exit_code=code)

    def find(self, *, job_id: str | None = None, root: str | None = None) -> list[Box]:
        self._answer()
        want = {LABEL: "1"} | ({JOB_LABEL: job_id} if job_id is not None else {})
        want |= {ROOT_LABEL: root} if root is not None else {}
        boxes = []
        for path in sorted(self.state.glob("*.json")) if self.state.is_dir() else []:
            data = self._load(path)
            if data is not None and want.items() <= data.get("labels", {}).items():
                boxes.append(self._box(data))
        return boxes

    def remove(self, box: Box) -> bool:
        """Kill the box's process group (when it is still the process the box recorded), then
        forget the box. False when it was gone already."""
        self._answer()
        if self.stuck is not None and self._path(box.id).exists():
            raise InfraError(f"the fake backend failed while removing box {box.name}: {self.stuck}")
        gone = self._drop(box.id)
        if gone:
            self.removed.append(box.id)
            del self.removed[:-KEPT]
        return gone

    def leave(self, job_id: str, *, root: str, worker: str, status: str = "running") -> Box:
        """A box as a killed worker leaves it (`created`: never started; `running`: played by this
        process while it lives; `exited`: exit code 0), for recovery's tests to find."""
        data: dict[str, Any] = {
            "id": secrets.token_hex(32),
            "name": container_name(job_id),
            "status": status,
            "labels": {ROOT_LABEL: root, WORKER_LABEL: worker, LABEL: "1", JOB_LABEL: job_id},
        }
        if status == "running":
            data |= {"pid": os.getpid(), "pid_started": start_time(os.getpid())}
        elif status == "exited":
            data["exit_code"] = 0
        self._save(data)
        return self._box(data)

    def _drop(self, box_id: str) -> bool:
        with self._boxes_locked():
            data = self._load(self._path(box_id))
            if data is None:
                return False
            if data.get("group") and alive(data.get("pid"), data.get("pid_started")):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(data["pid"], signal.SIGKILL)
            try:
                self._path(box_id).unlink()
            except FileNotFoundError:
                return False
            return True

    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        """No job networks here; gateway directories another backend's run left are swept."""
        from ..egress.config import sweep_dirs

        return sweep_dirs(meta_dir, has_claim)

    # -- a run ------------------------------------------------------------------------------------

    def _act(self, spec: RunSpec) -> Act | None:
        if self.script is None:
            return None
        if callable(self.script):
            return self.script(spec)
        return self.script.get(spec.job_id)

    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        with self._lock:
            self.specs.append(spec)
            del self.specs[:-KEPT]
        self._answer()
        waived = self.check(spec.policy, job_id=spec.job_id)
        act = self._act(spec)
        if act is not None and act.error is not None and act.error_at == "create":
            raise act.error
        ref = self.image(spec.image)
        if ref is None:
            raise ImageMissing(
                f"image {spec.image} is not one of the fake backend's images for job {spec.job_id}",
                hint="the fake backend knows only fila's own tags (FakeBackend(images=...) adds more)",
                task_id=spec.job_id,
            )
        name = container_name(spec.job_id)
        box: dict[str, Any] = {
            "id": secrets.token_hex(32),
            "name": name,
            "status": "created",
            "labels": {**spec.labels, LABEL: "1", JOB_LABEL: spec.job_id},
            "image": spec.image,
        }
        self._save(box)
        try:
            if before_start is not None:
                before_start(box["id"])
            self._event("start", box)
            result = self._execute(spec, act, box, heartbeat, heartbeat_s)
        except BaseException:
            self._drop(box["id"])  # never started, or stopped: like a container, it goes
            raise
        result.image_id, result.backend, result.waived = ref.id or "", self.name, waived
        if act is None:
            result.warnings.append(NOT_A_SANDBOX)
        if spec.defer_removal:
            result.removal = Removal(name, lambda: self._finish(spec, act, box))
        else:
            self._finish(spec, act, box)
        return result

    def _finish(self, spec: RunSpec, act: Act | None, box: dict[str, Any]) -> None:
        """The exited box's removal, or the scripted failure to remove it (the box stays)."""
        if act is not None and act.error_at == "remove" and act.error is not None:
            note_left(act.error, f"box {box['name']}; `fila recover` removes it", running=False)
            raise act.error
        self._path(box["id"]).unlink(missing_ok=True)

    def _execute(
        self,
        spec: RunSpec,
        act: Act | None,
        box: dict[str, Any],
        heartbeat: Callable[[], None] | None,
        heartbeat_s: float,
    ) -> RunResult:
        gone = lambda: not self._path(box["id"]).exists()  # noqa: E731 (removed under the run)
        home = Path(tempfile.mkdtemp(prefix="fila-fake-home-"))
        capture = Capture(spec.log_path, spec.policy.max_log_bytes, spec.redact)
        started_at, t0 = now_iso(), time.monotonic()
        ex: Command | Scripted | None = None
        try:
            if gone():  # removed between create and start: a container engine refuses the start
                raise InfraError(f"the fake backend's box {box['name']} was removed before it started")
            if act is None:
                ex = Command(spec, capture, home)
                box |= {"group": True}
            else:
                ex = Scripted(act, spec, capture, gone)
            pid = ex.pid or os.getpid()  # a script lives as long as the process playing it
            if not self._update(box | {"status": "running", "pid": pid, "pid_started": start_time(pid)}):
                raise InfraError(f"the fake backend's box {box['name']} was removed before it started")
            if isinstance(ex, Command):
                ex.go()
            if act is not None and act.error is not None and act.error_at == "start":
                raise act.error
            timed_out, stopped = self._wait(spec, ex, t0, heartbeat, heartbeat_s)
            ended_at, duration = now_iso(), time.monotonic() - t0
            code = ex.exit_code()
        except BaseException:
            if ex is not None:
                ex.signal(signal.SIGKILL)
                ex.wait(_KILL_WAIT_S)
            raise
        finally:
            output = capture.close()
            shutil.rmtree(home, ignore_errors=True)
        if not self._update(box | {"status": "exited", "exit_code": code}):
            raise InfraError(
                f"the fake backend's box {box['name']} was removed while it ran",
                task_id=spec.job_id,
                path=spec.log_path,
            )
        return RunResult(
            exit_code=code,
            timed_out=timed_out,
            oom_killed=False,
            started_at=started_at,
            ended_at=ended_at,
            duration_s=round(duration, 3),
            container_id=box["id"],
            container_name=box["name"],
            image_id="",
            log_bytes=capture.written,
            log_truncated=capture.truncated,
            output=output,
            stopped=stopped,
        )

    @staticmethod
    def _wait(
        spec: RunSpec,
        ex: Command | Scripted,
        t0: float,
        heartbeat: Callable[[], None] | None,
        heartbeat_s: float,
    ) -> tuple[bool, str | None]:
        """Until the exit, with heartbeats; at the host's timeout (or a heartbeat's StopRun)
        SIGTERM, then SIGKILL after the grace. (timed out, why the caller stopped it)."""
        deadline = t0 + min(spec.timeout_ms, spec.policy.max_timeout_ms) / 1000
        beat = max(heartbeat_s, 0.05)
        next_beat = t0 + beat
        stopped: str | None = None
        grace_s = spec.policy.grace_ms / 1000
        while not ex.wait(min(deadline, next_beat) - time.monotonic()):
            now = time.monotonic()
            if now >= deadline or stopped is not None:
                ex.signal(signal.SIGTERM)
                if not ex.wait(grace_s):
                    ex.signal(signal.SIGKILL)
                    if not ex.wait(_KILL_WAIT_S):
                        raise InfraError(
                            f"the fake backend's command survived SIGKILL for {_KILL_WAIT_S}s",
                            task_id=spec.job_id,
                        )
                return stopped is None, stopped
            if now >= next_beat:
                reason, grace_s = call_heartbeat(heartbeat, grace_s)
                if reason is not None:
                    stopped = reason  # stopped on the next turn, as at the timeout
                    continue
                next_beat = now + beat
        return False, stopped

    # -- images: a fixed set of tags --------------------------------------------------------------

    def image_info(self, tag: str) -> ImageInfo | None:
        for t, image_id in self._images.items():
            if tag in (t, image_id):
                same = [x for x, i in self._images.items() if i == image_id]
                return ImageInfo(id=image_id, labels={}, tags=same)
        return None

    def build(
        self,
        engine: str,
        *,
        base: str | None = None,
        ca_file: Path | None = None,
        force: bool = False,
        progress: Callable[[str], None] = print,
        verbose: bool = False,
    ) -> ImageRef:
        from .images import image_tag

        ref = self.image(image_tag(engine))
        if ref is None:
            raise ImageMissing(f"the fake backend has no image for engine {engine!r} (it builds nothing)")
        progress(f"{ref.tag}: up to date (the fake backend's images are fixed; nothing is built)")
        return ref

    def build_context(
        self,
        context: Path,
        tag: str,
        *,
        buildargs: dict[str, str],
        labels: dict[str, str],
        nocache: bool,
        progress: Callable[[str], None],
        network: str | None = None,
        dockerfile: str | None = None,
        target: str | None = None,
    ) -> None:
        raise ImageMissing(f"the fake backend builds no images ({tag})")

    def import_image(self, archive: Path, tag: str, changes: list[str]) -> None:
        raise ImageMissing(f"the fake backend imports no images ({tag})")

    def pull(self, image: str) -> str | None:
        return "the fake backend pulls nothing"

    def tag_image(self, image_id: str, tag: str) -> None:
        info = self.image_info(image_id)
        if info is None:
            raise ImageMissing(f"the fake backend has no image {image_id}")
        with self._lock:
            self._images[tag] = info.id

    def remove_image(self, ref: str) -> None:
        with self._lock:
            self._images = {t: i for t, i in self._images.items() if ref not in (t, i)}

    def smoke_run(self, image: str, argv: tuple[str, ...]) -> tuple[int | None, str]:
        raise InfraError("the fake backend runs no smoke test: it has no images to run anything in")

    def runtimes(self) -> list[str]:
        return []

    def runtime_for(self, policy: Policy) -> str | None:
        return policy.runtime

    @contextlib.contextmanager
    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> Iterator[tuple[str, str]]:
        raise InfraError("the fake backend makes no networks: the allowlist self-test needs Docker or Podman")
        yield ("", "")  # pragma: no cover (a generator, as contextmanager needs)


def _default_images() -> dict[str, str]:
    """Every engine's image and the gateway's, each with an id made from its tag."""
    from .images import GATEWAY_IMAGE, engines, image_tag

    tags = [image_tag(e) for e in engines() if e != "gateway"] + [GATEWAY_IMAGE]
    return {t: "sha256:" + hashlib.sha256(f"fila-fake:{t}".encode()).hexdigest() for t in tags}
