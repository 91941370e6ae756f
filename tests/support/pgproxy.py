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
    `heal` undoes either for new connections."""

    def __init__(self, upstream_sock_dir: str) -> None:
        self.up = os.path.join(upstream_sock_dir, ".s.PGSQL.5432")
        self.dir = tempfile.mkdtemp(prefix="pgproxy-")
        os.chmod(self.dir, 0o755)
        self.lsock = socket.socket(socket.AF_UNIX)
        self.lsock.bind(os.path.join(self.dir, ".s.PGSQL.5432"))
        self.lsock.listen(64)
        self.drop_commits = 0
        self.dropped = 0
        self.lock = threading.Lock()
        self.down = False  # `cut`: every connection broken, new ones refused
        self.frozen = False  # `freeze`: bytes read are dropped, nothing is closed
        self.silenced: set[socket.socket] = set()  # the client sockets a freeze silenced, for good
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str, real_sock: str) -> str:
        return url.replace(f"host={real_sock}", f"host={self.dir}")

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            if self.down:
                c.close()
                continue
            s = socket.socket(socket.AF_UNIX)
            s.connect(self.up)
            with self.lock:
                self.conns += [c, s]
                if self.frozen:
                    self.silenced.add(c)
            threading.Thread(target=self._c2s, args=(c, s), daemon=True).start()
            threading.Thread(target=self._s2c, args=(c, s), daemon=True).start()

    def cut(self) -> None:
        """The network between the clients and the server goes away: every connection through
        the proxy breaks, and new ones are refused (the server itself runs on)."""
        self.down = True
        with self.lock:
            conns, self.conns = self.conns, []
        self._shut(*conns)

    def freeze(self) -> None:
        """A silent partition: whatever either side sends is dropped, no connection is closed,
        new ones are accepted and hang (as a firewall that drops packets leaves them)."""
        with self.lock:
            self.frozen = True
            self.silenced |= set(self.conns[0::2])

    def heal(self) -> None:
        """The network is back: new connections go through (frozen ones stay silent)."""
        self.down = self.frozen = False

    def close(self) -> None:
        self.lsock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for x in socks:
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)

    def _c2s(self, c: socket.socket, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := c.recv(65536):
                if c not in self.silenced:
                    s.sendall(data)
        self._shut(c, s)

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
        self._shut(c, s)
        c.close()
        s.close()

    def _drop(self) -> bool:
        with self.lock:
            if self.drop_commits <= 0:
                return False
            self.drop_commits -= 1
            self.dropped += 1
            return True
