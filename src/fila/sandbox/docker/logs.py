"""The container's output: streamed to the job's log as it comes, redacted and capped, and kept
apart by stream for classification (core/output.py; docs/architecture.md, "Threat model in brief")."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import docker
from docker.constants import STREAM_HEADER_SIZE_BYTES
from docker.utils.socket import STDERR, STDOUT

from ...core import fsutil
from ...core.output import STDERR_TAIL, RunOutput
from ...workspace import secretscan
from .client import DOCKER_ERRORS

TAIL_ENTRIES = 16  # log entries read again after the followed stream ends (see LogPump)
SEEN_KEEP = 1 << 20  # each stream's last raw bytes the pump keeps to align that tail


def redactor(values: list[str]) -> secretscan.StreamMasker:
    """The log's redactor: each known credential and its usual encodings (secretscan), as ***."""
    return secretscan.Scanner(secretscan.Credential("", v) for v in values).stream(lambda _label: b"***")


def log_frames(
    client: docker.DockerClient,
    cid: str,
    *,
    follow: bool = True,
    tail: int | str = "all",
    opened: Callable[[Any], None] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """The container's output as (stream, bytes) frames, stdout (1) apart from stderr (2), as
    they come. The SDK's logs() drops the frame header's stream byte (its demux is for attach and
    exec only), so this is its own stream helper with the stream kept: the request, the socket
    without a read timeout, then the 8-byte header (stream, size) of each frame. `opened` gets
    the socket, so another thread can shut it and end a read that would otherwise never return."""
    api = client.api
    params = {"stdout": 1, "stderr": 1, "follow": int(follow), "timestamps": 0, "tail": tail}
    res = api._get(api._url("/containers/{0}/logs", cid), params=params, stream=True)
    try:
        api._raise_for_status(res)
        sock = api._get_raw_response_socket(res)
        api._disable_socket_timeout(sock)
        if opened is not None:
            opened(sock)
        while True:
            header = res.raw.read(STREAM_HEADER_SIZE_BYTES)
            if len(header) < STREAM_HEADER_SIZE_BYTES:
                return
            stream, length = struct.unpack(">BxxxL", header)
            data = res.raw.read(length) if length else b""
            if length and not data:
                return
            yield stream, data
    finally:
        res.close()


class LogPump(threading.Thread):
    """Copies the container's output to the log file as it comes (progress for long work), both
    streams interleaved as they came, and keeps them apart for classification (RunOutput):
    stdout up to the log's cap, stderr's last STDERR_TAIL bytes. Each stream has its own
    redactor, so a secret split across two frames of one stream is still caught.

    `open_stream` is called in this thread: Podman answers a follow request only once the
    container prints something, and a silent engine must not hold up the host's timeout and the
    heartbeat, which run in the caller's thread meanwhile.

    `open_tail` reads the last TAIL_ENTRIES entries once the followed stream has ended: Docker 20.10
    was seen to end a follow request before the container's last output reached it (a final line
    without a newline, e.g. gemini's closing `}`); what the tail has beyond what was seen is added.

    `cut_off` ends a stream that did not end with the container (a busy daemon): from then on
    nothing more is copied, and stdout counts as truncated (classification must not read a part
    as the whole). The log file is fsynced before the pump ends: the record points at it."""

    def __init__(
        self,
        open_stream: Callable[[], Iterable[tuple[int, bytes]]],
        path: Path,
        cap: int,
        redact: list[str],
        open_tail: Callable[[], Iterable[tuple[int, bytes]]] | None = None,
    ) -> None:
        super().__init__(name=f"fila-log-{path.name}", daemon=True)
        self.open_stream, self.path, self.cap, self.open_tail = open_stream, path, cap, open_tail
        self.seen = {STDOUT: bytearray(), STDERR: bytearray()}  # each stream's raw end, to align the tail
        self.stream: Iterable[tuple[int, bytes]] = ()
        self.redactors = {STDOUT: redactor(redact), STDERR: redactor(redact)}
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.stderr_dropped = False
        self.written = 0
        self.truncated = False
        self.cut = False  # the stream was cut off after the exit: what was copied is a part
        self.lock = threading.Lock()  # no write lands after cut_off returns
        self.sockets: list[Any] = []  # the open streams' sockets (`log_frames`'s `opened`)
        self.error: BaseException | None = None

    def cut_off(self) -> None:
        """Stop copying (called from another thread), then shut the stream's socket so a read
        blocked on it returns."""
        with self.lock:
            self.cut = True
        for sock in list(self.sockets):
            with contextlib.suppress(OSError, AttributeError):
                getattr(sock, "_sock", sock).shutdown(socket.SHUT_RDWR)

    def _write(self, f: Any, stream: int, data: bytes) -> None:
        with self.lock:
            if not self.cut:
                self._write_locked(f, stream, data)

    def _write_locked(self, f: Any, stream: int, data: bytes) -> None:
        room = self.cap - self.written
        if len(data) > room:
            data, self.truncated = data[:room], True
        f.write(data)
        f.flush()
        self.written += len(data)
        if stream == STDOUT:
            self.stdout += data  # within the log's cap, so never more than it
        else:
            self.stderr += data
            if len(self.stderr) > STDERR_TAIL:
                del self.stderr[: len(self.stderr) - STDERR_TAIL]
                self.stderr_dropped = True

    def _copy(self, f: Any, stream: int, chunk: bytes) -> None:
        seen = self.seen[stream]
        seen += chunk
        if len(seen) > SEEN_KEEP:
            del seen[: len(seen) - SEEN_KEEP]
        if not self.truncated:
            self._write(f, stream, self.redactors[stream].feed(chunk))

    def _missed(self) -> list[tuple[int, bytes]]:
        """The entries of the log's tail after the longest run of them that ends what was seen."""
        if self.open_tail is None or self.cut:
            return []
        entries: dict[int, list[bytes]] = {STDOUT: [], STDERR: []}
        try:
            for stream, chunk in self.open_tail():
                if stream in entries:
                    entries[stream].append(chunk)
        except DOCKER_ERRORS:
            return []  # best effort: the followed stream already gave the run's output
        missed = []
        for stream, got in entries.items():
            seen = bytes(self.seen[stream])
            for j in range(len(got), 0 if seen else -1, -1):
                if seen.endswith(b"".join(got[:j])):
                    missed += [(stream, chunk) for chunk in got[j:]]
                    break
        return missed

    def output(self) -> RunOutput:
        return RunOutput(
            stdout=bytes(self.stdout),
            stderr=bytes(self.stderr),
            stdout_truncated=self.truncated or self.cut,
            stderr_truncated=self.stderr_dropped or self.cut,
        )

    def run(self) -> None:
        try:
            with open(self.path, "wb") as f:
                fsutil.fsync_dir(self.path.parent)  # the record will point at this file
                self.stream = self.open_stream()
                for stream, chunk in self.stream:
                    if stream not in self.redactors:
                        continue  # stdin's stream id: the engine has no stdin
                    self._copy(f, stream, chunk)
                    if self.truncated or self.cut:
                        break  # stop reading: a log bomb must not cost us the rest of it
                else:
                    for stream, chunk in self._missed():
                        self._copy(f, stream, chunk)
                    for stream, redactor in self.redactors.items():
                        self._write(f, stream, redactor.flush())
                with self.lock:
                    if self.truncated and not self.cut:
                        f.write(f"\n[fila: log truncated at {self.cap} bytes]\n".encode())
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as e:  # reported by run(); a thread cannot raise to its caller
            self.error = e
        finally:
            close = getattr(self.stream, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):  # already broken: nothing left to release
                    close()
