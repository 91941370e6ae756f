"""How the fake backend (sandbox/fake.py) plays one job: its command on the host, or a script
(`Act`), with the output into the log as the container backends write it. Not a sandbox."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..core.errors import InfraError
from ..core.output import STDERR_TAIL, RunOutput
from .base import RunSpec

_JOB_MOUNT = re.compile(r"(?<![\w.-])/job\b(?![.-])")  # engines.base.JOB_MOUNT as a path prefix
_PLAIN_PATH = re.compile(r"[\w./+-]+")  # spliced into shell scripts unquoted: nothing to escape
_GATE = 'IFS= read -r _ || exit 125; exec </dev/null; exec "$@"'  # see Command.__init__
_POLL_S = 0.05  # how often a scripted run looks whether its box was removed under it


@dataclass(frozen=True)
class Act:
    """What a scripted job does instead of running its command."""

    exit_code: int = 0
    stdout: bytes | str = b""
    stderr: bytes | str = b""
    seconds: float = 0.0  # how long the "engine" runs (heartbeats and the timeout apply)
    stall: bool = False  # it never exits by itself: only the host's timeout or a removal ends it
    files: Mapping[str, bytes | str | None] = field(default_factory=dict)  # into work/; None deletes
    error: BaseException | None = None  # raised by run() at `error_at`
    # create: before any box (nothing started); start: once the box started (it is removed);
    # remove: the run ended but its box cannot be removed (it stays, for recovery)
    error_at: Literal["create", "start", "remove"] = "create"


Script = Mapping[str, Act] | Callable[[RunSpec], Act | None]


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), None when it is gone: with the
    pid it names one process, never a later one that reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def alive(pid: int | None, started: str | None) -> bool:
    return pid is not None and started is not None and start_time(pid) == started


class Capture:
    """The run's output into its log as it comes, redacted per stream and capped at the policy's
    max_log_bytes; stdout kept whole (within the cap) and stderr's tail for classification."""

    def __init__(self, path: Path, cap: int, redact: list[str]) -> None:
        from ..core.fsutil import fsync_dir
        from ..workspace import secretscan

        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close(), after both readers ended)
        fsync_dir(path.parent)  # the record will point at this file
        self.cap, self.written, self.truncated, self.lock = cap, 0, False, threading.Lock()
        scanner = secretscan.Scanner(secretscan.Credential("", v) for v in redact)
        self.maskers = {n: scanner.stream(lambda _label: b"***") for n in (1, 2)}
        self.kept = {1: bytearray(), 2: bytearray()}
        self.stderr_dropped = False

    def feed(self, stream: int, chunk: bytes) -> None:
        with self.lock:
            self._write(stream, self.maskers[stream].feed(chunk))

    def _write(self, stream: int, data: bytes) -> None:
        if self.truncated or not data:
            return  # past the cap the output is drained and dropped: the process never blocks
        room = self.cap - self.written
        if len(data) > room:
            data, self.truncated = data[:room], True
        self.f.write(data)
        self.f.flush()
        self.written += len(data)
        kept = self.kept[stream]
        kept += data
        if stream == 2 and len(kept) > STDERR_TAIL:
            del kept[: len(kept) - STDERR_TAIL]
            self.stderr_dropped = True

    def close(self) -> RunOutput:
        with self.lock:
            for stream, masker in self.maskers.items():
                self._write(stream, masker.flush())
            if self.truncated:
                self.f.write(f"\n[fila: log truncated at {self.cap} bytes]\n".encode())
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        return RunOutput(bytes(self.kept[1]), bytes(self.kept[2]), self.truncated, self.stderr_dropped)


class Command:
    """The job's command on the host, in a session of its own (signals reach its whole group)."""

    def __init__(self, spec: RunSpec, capture: Capture, home: Path) -> None:
        job = str(spec.job_dir.resolve())
        if not _PLAIN_PATH.fullmatch(job):
            raise InfraError(
                "the fake backend maps /job to the job directory inside shell scripts unquoted, so its "
                f"path may hold only letters, digits and ./+-_: {job!r}",
                task_id=spec.job_id,
            )
        env = {k: _JOB_MOUNT.sub(job, v) for k, v in spec.env.items()}
        env = {"PATH": os.defpath, **env, "HOME": str(home)}
        # The command waits at a gate until its box records its pid (`go`): a fila killed in
        # between closes the gate's pipe, and the command exits unrun, as a container never started.
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", _GATE, "fila-fake-gate", *(_JOB_MOUNT.sub(job, a) for a in spec.argv)],
            cwd=spec.job_dir / "work",
            env=env,
            stdin=subprocess.PIPE,  # the gate; the command itself gets /dev/null, as a container
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.readers = [
            threading.Thread(target=self._read, args=(pipe, n, capture), daemon=True)
            for n, pipe in ((1, self.proc.stdout), (2, self.proc.stderr))
        ]
        for r in self.readers:
            r.start()

    def go(self) -> None:
        with contextlib.suppress(BrokenPipeError), self.proc.stdin as gate:  # type: ignore[union-attr]
            gate.write(b"go\n")

    @staticmethod
    def _read(pipe: Any, stream: int, capture: Capture) -> None:
        with pipe:
            for chunk in iter(lambda: os.read(pipe.fileno(), 1 << 16), b""):
                capture.feed(stream, chunk)

    def wait(self, seconds: float) -> bool:
        try:
            self.proc.wait(max(seconds, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def exit_code(self) -> int:
        for r in self.readers:  # the output ends with the process (a child holding it: cut)
            r.join(timeout=2.0)
        code = self.proc.returncode
        return 128 - code if code < 0 else code


class Scripted:
    """An `Act` played in this process: its output at the start, its files at the exit."""

    def __init__(self, act: Act, spec: RunSpec, capture: Capture, gone: Callable[[], bool]) -> None:
        self.act, self.spec, self.gone, self.pid = act, spec, gone, None
        self.end = time.monotonic() + act.seconds
        self.killed: int | None = None
        for stream, data in ((1, act.stdout), (2, act.stderr)):
            capture.feed(stream, data.encode() if isinstance(data, str) else data)

    def wait(self, seconds: float) -> bool:
        until = time.monotonic() + max(seconds, 0.0)
        while True:
            if self.killed is not None or self.gone():
                self.killed = self.killed or 128 + signal.SIGKILL
                return True
            now = time.monotonic()
            if not self.act.stall and now >= self.end:
                return True
            if now >= until:
                return False
            left = _POLL_S if self.act.stall else self.end - now
            time.sleep(max(0.0, min(_POLL_S, until - now, left)))

    def signal(self, sig: int) -> None:
        self.killed = 128 + sig

    def exit_code(self) -> int:
        if self.killed is not None:
            return self.killed
        work = self.spec.job_dir / "work"
        for name, content in self.act.files.items():
            path = work / name
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content.encode() if isinstance(content, str) else content)
        return self.act.exit_code
