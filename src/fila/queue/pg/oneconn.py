"""One connection where a pool is not needed: what `Database` asks of psycopg_pool's
`ConnectionPool` (`connection(timeout)`, `close()`), for a process that makes one call at a time
(`fila submit --queue URL`): the pool's module, its worker threads and the connection it opens
in the background are work a single submit never uses (measured in docs/benchmarks.md, "The
one-shot path": a small saving on this machine).

The connection is made at first use and again after it broke (the caller, `Database._tx`, runs
the transaction again, as it does when a pooled connection breaks).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class OneConnection:
    """A pool of one connection, made lazily; calls from several threads take turns."""

    def __init__(self, url: str, kwargs: dict[str, Any], configure: Callable[[Any], None] | None) -> None:
        self.url, self.kwargs, self.configure = url, kwargs, configure
        self._lock = threading.Lock()
        self._conn: Any = None

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Any]:
        """The connection, for the block; one that broke inside it, or is left inside a
        transaction, is closed and made again at the next call. `timeout` is the pool's wait for
        a free connection: there is none to wait for here."""
        import psycopg
        from psycopg.pq import TransactionStatus

        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.url, **self.kwargs)
                if self.configure is not None:
                    self.configure(self._conn)
            conn = self._conn
            try:
                yield conn
            finally:
                if conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.close()
                    self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
