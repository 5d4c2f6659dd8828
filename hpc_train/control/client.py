"""An agent's (or a rank's) connection to its job's coordinator (:mod:`hpc_train.control.server`).

Requests are answered in order; what the coordinator pushes for a watched prefix lands in :attr:`known`, a
local dict, so an agent that checks for a restart notice five times a second asks its own memory, not the
network and not the file system. A lost coordinator sets :attr:`broken`: the caller falls back to the run
folder's files, which are still written at every event as the durable record.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from typing import Any

from hpc_train.control.server import keep_alive
from hpc_train.control.wire import LineBuffer, WireError, decode, encode

__all__ = ["ControlClient", "ControlError"]

_REPLY_S = 30.0  # a coordinator that does not answer a request within this is taken for lost


class ControlError(OSError):
    """The coordinator cannot be reached or stopped answering."""


class ControlClient:
    """``ControlClient.connect(host, port, token, member)``; then ``set``, ``get``, ``arrive``, ``watch`` and
    ``wait_for``; ``close()`` says bye (a member that vanishes without it is reported lost)."""

    def __init__(self, sock: socket.socket, reply_s: float = _REPLY_S) -> None:
        self._sock = sock
        self.reply_s = reply_s
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one request at a time on the socket
        self._changed = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.known: dict[str, Any] = {}
        self.broken = False
        self._reader = threading.Thread(target=self._read, name="hpc_train-control-client", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, host: str, port: int, token: str, member: str, timeout_s: float = 10.0,
                agent: bool = False, reply_s: float = _REPLY_S) -> ControlClient:
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            raise ControlError(f"the coordinator at {host}:{port} cannot be reached: {error}") from None
        sock.settimeout(None)
        keep_alive(sock)
        client = cls(sock, reply_s)
        client._request({"op": "hello", "token": token, "member": member, "agent": agent})
        return client

    # --- requests --------------------------------------------------------------------------------------------

    def set(self, key: str, value: Any, first: bool = False) -> Any:
        """Set ``key``; with ``first``, only if nobody did before. The value that holds."""
        return self._request({"op": "set", "key": key, "value": value, "first": first}).get("value")

    def get(self, key: str) -> Any:
        return self._request({"op": "get", "key": key}).get("value")

    def arrive(self, key: str, member: str, expected: int) -> int:
        """Count ``member`` into barrier ``key``; once ``expected`` members did, ``key`` is set (watch it)."""
        return int(self._request({"op": "arrive", "key": key, "member": member, "expected": expected})["count"])

    def watch(self, prefix: str) -> None:
        """Every key under ``prefix``, set now or later, is pushed into :attr:`known`."""
        self._request({"op": "watch", "prefix": prefix})

    def wait_for(self, key: str, timeout_s: float) -> Any:
        """The value of watched ``key`` once it is set, or None after ``timeout_s`` (or once the link broke)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while key not in self.known and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self.known.get(key)

    def close(self) -> None:
        if not self.broken:
            with contextlib.suppress(ControlError, OSError):
                self._request({"op": "bye"}, timeout_s=2.0)
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        timeout_s = self.reply_s if timeout_s is None else timeout_s
        with self._lock:
            ident = next(self._ids)
            try:
                self._sock.sendall(encode({**message, "id": ident}))
            except OSError as error:
                self._break()
                raise ControlError(f"the coordinator went away: {error}") from None
            deadline = time.monotonic() + timeout_s
            with self._changed:
                while ident not in self._replies:
                    left = deadline - time.monotonic()
                    if self.broken or left <= 0:
                        self.broken = True  # no answer in time is a coordinator gone: the caller reads the files
                        self._changed.notify_all()
                        raise ControlError("the coordinator stopped answering")
                    self._changed.wait(left)
                return self._replies.pop(ident)

    # --- the reader thread -----------------------------------------------------------------------------------

    def _read(self) -> None:
        buffer = LineBuffer()
        try:
            while chunk := self._sock.recv(65536):
                for line in buffer.feed(chunk):
                    self._take(decode(line))
        except (OSError, WireError):
            pass
        self._break()

    def _take(self, message: dict[str, Any]) -> None:
        with self._changed:
            if message.get("event") == "set" and isinstance(message.get("key"), str):
                self.known[message["key"]] = message.get("value")
            elif isinstance(message.get("re"), int):
                self._replies[message["re"]] = message
            self._changed.notify_all()

    def _break(self) -> None:
        with self._changed:
            self.broken = True
            self._changed.notify_all()
