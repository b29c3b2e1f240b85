"""A TCP proxy in front of a server that a test can cut off and reconnect: a server "held back" by
the network (a partition, a node that stops answering for a while) while its process keeps running
and keeps what it holds, unlike a restarted pod."""

from __future__ import annotations

import contextlib
import socket
import threading


class BlockingProxy:
    """Forwards 127.0.0.1:<port> to `target` ("host:port"). `block()` drops every open connection
    and refuses new ones (connections are accepted and closed at once: the client sees the peer go
    away, as when a node is cut off); `unblock()` forwards again."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._blocked = False
        self._open: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  # connections refused while blocked
        threading.Thread(target=self._accept, name="blocking-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def block(self) -> None:
        with self._lock:
            self._blocked = True
            open_now, self._open = self._open, set()
        for s in open_now:
            _close(s)

    def unblock(self) -> None:
        with self._lock:
            self._blocked = False

    def close(self) -> None:
        self._closed = True
        self.block()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                blocked = self._blocked
                if blocked:
                    self.refused += 1
            if blocked:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {src, dst}
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
