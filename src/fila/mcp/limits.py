"""What one MCP client may hold of the server at once (docs/mcp.md, "Limits").

A `wait` is asynchronous: it polls the record with `anyio.sleep` (cancelled with its call), and
each read of the record takes a thread of its own limiter, never one of the threads the SDK runs
the other tools in; so waiting clients cannot stall a `status` or a `submit`. How many waits may
be in progress at once is bounded per session and per server: one beyond is refused at once, with
a message, rather than queued behind the others.

A submit is refused while as many tasks this server submitted as `--max-live-tasks` are queued or
running: each copies up to 1 MiB of the project and takes a worker's turn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

from ..api.client import PENDING, Client
from ..core.errors import LimitExceeded, NotFound

# Waits in progress at once: of one session (an agent has a few sub-tasks in flight), and of the
# whole server (every session's).
WAITS_PER_SESSION = 4
WAITS_PER_SERVER = 32
# Threads reading records for waits (the file's or the database's), beside the SDK's own pool.
WAIT_READERS = 4


class Waits:
    """The waits in progress, by session; `slot` takes one or refuses (LimitExceeded)."""

    def __init__(self, per_session: int = WAITS_PER_SESSION, per_server: int = WAITS_PER_SERVER) -> None:
        self.per_session, self.per_server = per_session, per_server
        self.held: dict[str, int] = {}
        self.readers = anyio.CapacityLimiter(WAIT_READERS)

    @contextmanager
    def slot(self, key: str) -> Iterator[None]:
        # One event loop runs every call: the counts change between awaits only, never mid-update.
        if self.held.get(key, 0) >= self.per_session:
            raise LimitExceeded(
                f"{self.per_session} waits of this client are in progress: at most {self.per_session}",
                hint="wait for one of them to end, or cancel one",
            )
        if sum(self.held.values()) >= self.per_server:
            raise LimitExceeded(
                f"{self.per_server} waits are in progress on this server: at most {self.per_server}",
                hint="call wait again in a while, or status",
            )
        self.held[key] = self.held.get(key, 0) + 1
        try:
            yield
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]


class Live:
    """The tasks this server submitted that were queued or running when last looked at."""

    def __init__(self, client: Client, most: int) -> None:
        self.client, self.most = client, most
        self.ids: set[str] = set()
        self.lock = threading.Lock()  # submits run in the SDK's threads: one at a time here

    def pending(self, tid: str) -> bool:
        try:
            return self.client.record(tid).status in PENDING
        except NotFound:
            return False

    @contextmanager
    def slot(self) -> Iterator[Callable[[str], None]]:
        """Refuse (LimitExceeded) while `most` are live; else yield what records a submitted id."""
        with self.lock:
            self.ids = {tid for tid in self.ids if self.pending(tid)}
            if len(self.ids) >= self.most:
                raise LimitExceeded(
                    f"{len(self.ids)} tasks submitted through this MCP server are queued or running: "
                    f"at most {self.most}",
                    hint="wait for one to end (wait, status), or ask the operator for --max-live-tasks",
                )
            yield self.ids.add
