"""A TCP proxy in front of PostgreSQL that loses replies and cuts connections on cue.

Real network faults, not mocks: every byte between the clients and the server goes
through real sockets, and the server really runs (and, in autocommit, commits)
every statement it receives.

- `arm(trigger, refuse_for)`: the next client-to-server chunk containing `trigger` is
  forwarded, the server's reply (sent once the statement ran and, in autocommit,
  committed) is awaited and thrown away, both sides are closed, and for `refuse_for`
  seconds every new connection is accepted and closed at once: what a server crash or
  failover right after a commit looks like to a client. `fired` is set, and
  `fired_data` holds the chunk.
- `cut()`: close every open connection and refuse new ones until `heal()`: the
  server is unreachable for as long as the test wants. `refused` counts the
  connections refused so far: how often clients tried meanwhile.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

#: The longest wait for the server's reply to the triggering statement.
REPLY_TIMEOUT_SECONDS = 10.0


class FaultProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(128)
        self.port: int = self.listener.getsockname()[1]
        self.fired = threading.Event()
        self.fired_data = b""
        self._lock = threading.Lock()
        self._trigger: bytes | None = None
        self._refuse_for = 0.0
        self._refuse_until = 0.0
        self._cut = False
        self.refused = 0
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, direct_url: str, server_port: int) -> str:
        """`direct_url` (a URL on the server's port) through this proxy."""
        return direct_url.replace(f":{server_port}/", f":{self.port}/")

    def arm(self, trigger: bytes, refuse_for: float = 0.0) -> None:
        with self._lock:
            self._trigger = trigger
            self._refuse_for = refuse_for
            self.fired.clear()

    def cut(self) -> None:
        """Close every open connection; refuse new ones until `heal()`."""
        with self._lock:
            self._cut = True
            doomed = list(self._open)
        for sock in doomed:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()

    def _refusing(self) -> bool:
        with self._lock:
            return self._cut or time.monotonic() < self._refuse_until

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._refusing():
                self.refused += 1
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, server))
            doomed, replied = threading.Event(), threading.Event()
            threading.Thread(
                target=self._up, args=(client, server, doomed, replied), daemon=True
            ).start()
            threading.Thread(
                target=self._down, args=(server, client, doomed, replied), daemon=True
            ).start()

    def _up(
        self,
        client: socket.socket,
        server: socket.socket,
        doomed: threading.Event,
        replied: threading.Event,
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = client.recv(65536)
                if not data:
                    break
                with self._lock:
                    fire = self._trigger is not None and self._trigger in data
                    if fire:
                        self._trigger = None
                        doomed.set()
                        self._refuse_until = time.monotonic() + self._refuse_for
                server.sendall(data)
                if fire:
                    # The server replies once the statement ran (and committed).
                    replied.wait(REPLY_TIMEOUT_SECONDS)
                    self.fired_data = data
                    self.fired.set()
                    break
        self._drop(client, server)

    def _down(
        self,
        server: socket.socket,
        client: socket.socket,
        doomed: threading.Event,
        replied: threading.Event,
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = server.recv(65536)
                if not data:
                    break
                if doomed.is_set():  # once doomed, every reply is lost
                    replied.set()
                    continue
                client.sendall(data)
        replied.set()
        self._drop(client, server)

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)
        for sock in socks:
            _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
