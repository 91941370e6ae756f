"""A unix-socket proxy in front of the tests' throwaway PostgreSQL cluster that can drop the
server's reply to a COMMIT: the commit happened, the client sees its connection break. This is
the one failure a retried transaction must recognise as its own earlier write."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import tempfile
import threading


class Proxy:
    """Listens in a directory of its own as `.s.PGSQL.5432`; `url(pg_url, sock)` points a URL at
    it. Set `drop_commits` to N to drop the next N COMMIT replies (`dropped` counts them); `cut`
    breaks every connection, `freeze` silences them (a partition that drops packets, no reset),
    `heal` undoes either for new connections; `close` ends it, its threads included.

    The proxy shares its process with the clients it serves, so it never lets a socket number go
    while one of its threads may still use it: a number a close frees is the next socket's, a
    client's or another proxy's, and a late accept, shutdown or recv on it would break that one.
    So the accept loop wakes every POLL_S to see whether it is closed (close waits for it before
    the listening socket goes), and a connection's two sockets are shut and closed only under the
    lock, closed by the last of its two threads to end."""

    POLL_S = 0.1

    def __init__(self, upstream_sock_dir: str) -> None:
        self.up = os.path.join(upstream_sock_dir, ".s.PGSQL.5432")
        self.dir = tempfile.mkdtemp(prefix="pgproxy-")
        os.chmod(self.dir, 0o755)
        self.lsock = socket.socket(socket.AF_UNIX)
        self.lsock.bind(os.path.join(self.dir, ".s.PGSQL.5432"))
        self.lsock.listen(64)
        self.lsock.settimeout(self.POLL_S)
        self.drop_commits = 0
        self.dropped = 0
        self.lock = threading.Lock()
        self.closed = False
        self.down = False  # `cut`: every connection broken, new ones refused
        self.frozen = False  # `freeze`: bytes read are dropped, nothing is closed
        self.silenced: set[socket.socket] = set()  # the client sockets a freeze silenced, for good
        self.pairs: dict[socket.socket, tuple[socket.socket, int]] = {}  # client: (server, ends)
        self.threads: list[threading.Thread] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def url(self, url: str, real_sock: str) -> str:
        return url.replace(f"host={real_sock}", f"host={self.dir}")

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            c.settimeout(None)
            if self.down:
                c.close()
                continue
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.up)
            except OSError:  # the server is down: the client sees its connection close
                c.close()
                s.close()
                continue
            with self.lock:
                self.pairs[c] = (s, 0)
                if self.frozen:
                    self.silenced.add(c)
                for fn in (self._c2s, self._s2c):
                    t = threading.Thread(target=fn, args=(c, s), daemon=True)
                    self.threads.append(t)
                    t.start()

    def cut(self) -> None:
        """The network between the clients and the server goes away: every connection through
        the proxy breaks, and new ones are refused (the server itself runs on)."""
        self.down = True
        with self.lock:
            for c, (s, _) in self.pairs.items():
                self._shut(c, s)

    def freeze(self) -> None:
        """A silent partition: whatever either side sends is dropped, no connection is closed,
        new ones are accepted and hang (as a firewall that drops packets leaves them)."""
        with self.lock:
            self.frozen = True
            self.silenced |= set(self.pairs)

    def heal(self) -> None:
        """The network is back: new connections go through (frozen ones stay silent)."""
        self.down = self.frozen = False

    def close(self) -> None:
        """Stop accepting, break every connection, wait for every thread, then let the sockets go."""
        self.closed = True
        self.acceptor.join(10)
        self.cut()
        for t in list(self.threads):
            t.join(10)
        self.lsock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for x in socks:
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)

    def _end(self, c: socket.socket, s: socket.socket) -> None:
        """One direction ended: both sockets are shut, so the other direction's recv returns;
        the second direction to end closes them."""
        with self.lock:
            self._shut(c, s)
            ends = self.pairs[c][1] + 1
            if ends < 2:
                self.pairs[c] = (s, ends)
                return
            del self.pairs[c]
            self.silenced.discard(c)
            c.close()
            s.close()

    def _c2s(self, c: socket.socket, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := c.recv(65536):
                if c not in self.silenced:
                    s.sendall(data)
        self._end(c, s)

    def _s2c(self, c: socket.socket, s: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while data := s.recv(65536):
                if c in self.silenced:
                    continue
                buf += data
                out = b""
                while len(buf) >= 5:
                    (n,) = struct.unpack("!I", buf[1:5])
                    if len(buf) < 1 + n:
                        break
                    msg, buf = buf[: 1 + n], buf[1 + n :]
                    if msg[0:1] == b"C" and msg[5:] == b"COMMIT\x00" and self._drop():
                        c.sendall(out)  # everything before the commit's reply, then the break
                        raise ConnectionAbortedError
                    out += msg
                if out:
                    c.sendall(out)
        self._end(c, s)

    def _drop(self) -> bool:
        with self.lock:
            if self.drop_commits <= 0:
                return False
            self.drop_commits -= 1
            self.dropped += 1
            return True
