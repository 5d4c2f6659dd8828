"""The coordinator: a small key-value server one agent of a job hosts, which every agent of the job talks to.

Why not the run folder: agents that poll shared files cost the metadata server work per rank per second, and a
barrier made of per-rank marker files costs every agent N stats a scan (O(N^2) in all). Here an agent says
ready once and hears "all ready" once (O(N) messages in all), hears a restart notice the moment one is set, and
its node is known lost the moment its connection drops (TCP keep-alive catches a dead host), not when a file is
late. One thread, one ``selectors`` loop: the messages are few and small, so one thread serves thousands of
agents; a client that sends what is not a bounded JSON line, or no token, is disconnected.

Operations (see :mod:`hpc_train.control.client`): ``hello`` (the job's token and a member name), ``set`` (with
``first``: the first value set holds, as an ``O_EXCL`` file did), ``get``, ``arrive`` (a barrier: once
``expected`` distinct members arrived or are gone, its key is set, naming the gone), ``watch`` (every key with
a prefix, now and later, is pushed), ``bye``. An agent (a hello with ``agent``) that leaves gets
``left/MEMBER`` set, or ``lost/MEMBER`` when it vanished without ``bye``, and ``gone`` counts them.
"""

from __future__ import annotations

import contextlib
import hmac
import resource
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hpc_train.control.wire import LineBuffer, WireError, decode, encode

__all__ = ["GONE_KEY", "ControlServer", "keep_alive"]

GONE_KEY = "gone"  # how many agents left or vanished: one push a round, for agents that wait on a peer
_MAX_PENDING = 4 * 1024 * 1024  # bytes queued for one client that does not read: it is dropped
_KEEPALIVE_S = 5  # idle seconds before the first probe, and between probes (torchelastic: 5 s)
_KEEPALIVE_PROBES = 3
_HELLO_S = 5.0  # a connection's first line, the hello with the job's token, comes within this
_HELLO_BYTES = 1024  # ... and within this many bytes
_MAX_GONE_NAMED = 2000  # gone agents a barrier's value names (its line stays under MAX_LINE)


def keep_alive(sock: socket.socket) -> None:
    """A peer whose host died is noticed within about 20 s even when nothing is being sent."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_S), ("TCP_KEEPINTVL", _KEEPALIVE_S),
                        ("TCP_KEEPCNT", _KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class _Conn:
    sock: socket.socket
    opened: float = 0.0  # monotonic: a connection that says no hello within _HELLO_S is closed
    buffer: LineBuffer = field(default_factory=LineBuffer)
    pending: bytearray = field(default_factory=bytearray)
    member: str | None = None
    agent: bool = False  # a member of the job (lost or left is news), not a rank's one-off publisher
    said_bye: bool = False
    prefixes: list[str] = field(default_factory=list)


@dataclass
class _Barrier:
    expected: int
    members: set[str] = field(default_factory=set)


def _more_descriptors() -> None:
    """One socket per agent: a job of thousands of agents needs more than the usual soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536),
                                                    hard))


class ControlServer:
    """Serve one job's agents from a thread: ``start()``, then ``address``; ``stop()`` at the end."""

    def __init__(self, token: str, host: str = "0.0.0.0", port: int = 0) -> None:  # noqa: S104 (every node)
        self.token = token
        self.values: dict[str, Any] = {}
        self._barriers: dict[str, _Barrier] = {}
        self._gone: set[str] = set()  # agents that left or were lost
        self._departed: deque[tuple[str, str]] = deque()  # ... and not yet announced
        self._lost: list[str] = []  # the agents that vanished without a bye, in order
        self._accept_paused_until = 0.0
        self._swept = 0.0
        self._conns: dict[int, _Conn] = {}
        # prefix: the connections watching it (by descriptor). A set reaches its watchers without a look at every
        # connection: 16,384 ranks each setting a key at a save, with 32,768 connections open, were 5 * 10^8 looks
        self._watchers: dict[str, dict[int, _Conn]] = {}
        self._selector = selectors.DefaultSelector()
        _more_descriptors()
        self._listener = socket.create_server((host, port), backlog=4096, reuse_port=False)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpc_train-control", daemon=True)
        self.messages = 0  # requests served: what the protocol's tests count

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._close(conn, lost=False)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    # --- the loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                for key, events in self._selector.select(timeout=1.0):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        return
                    else:
                        self._serve(key.fd, events)
                self._announce_departures()
                self._sweep()
        except Exception:  # a coordinator that cannot go on says so the one way every client hears: it hangs up
            for conn in list(self._conns.values()):
                with contextlib.suppress(OSError):
                    conn.sock.close()
            self._conns.clear()
            raise

    def _sweep(self) -> None:
        """Once a second: close connections that said no hello within :data:`_HELLO_S` (a stranger's sockets
        cost descriptors), and listen again after a pause for want of them."""
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            with contextlib.suppress(KeyError, ValueError):
                self._selector.register(self._listener, selectors.EVENT_READ)
        if now - self._swept < 1.0:
            return
        self._swept = now
        for conn in [c for c in self._conns.values() if c.member is None and now - c.opened > _HELLO_S]:
            self._close(conn, lost=False)

    def _serve(self, fd: int, events: int) -> None:
        conn = self._conns.get(fd)
        if conn is None:
            return
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                self._read(conn)
        except Exception:  # one client's surprise must not end the coordinator of every agent
            self._close(conn, lost=not conn.said_bye)

    def _announce_departures(self) -> None:
        """The agents that left or vanished since the last round, announced together: a send that fails while
        announcing one finds another gone, which joins the queue (never a nested close), and the agents hear
        one ``gone`` push per round however many went (a node's worth of agents is one push each, not eight)."""
        if not self._departed:
            return
        while self._departed:
            state, member = self._departed.popleft()
            self._gone.add(member)
            if state == "lost":
                self._lost.append(member)
            self._set(f"{state}/{member}", {"member": member, "time": time.time()}, first=True)
        hosts = sorted({name.partition("@")[2] for name in self._lost if "@" in name})  # MEMBER@NODE: the nodes
        self._set(GONE_KEY, {"count": len(self._gone), "lost": len(self._lost), "names": self._lost[-8:],
                             "nodes": hosts[:_MAX_GONE_NAMED], "time": time.time()}, first=False)
        for key, barrier in list(self._barriers.items()):
            self._complete(key, barrier)

    def _accept(self) -> None:
        try:
            while True:
                sock, _peer = self._listener.accept()
                sock.setblocking(False)
                keep_alive(sock)
                conn = _Conn(sock, opened=time.monotonic())
                self._conns[sock.fileno()] = conn
                self._selector.register(sock, selectors.EVENT_READ)
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:  # out of descriptors (EMFILE, ENFILE) or memory: stop listening for a second
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._accept_paused_until = time.monotonic() + 1.0

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn, lost=not conn.said_bye)
            return
        if conn.member is None and len(chunk) + len(conn.buffer) > _HELLO_BYTES:
            self._close(conn, lost=False)  # a hello is a few dozen bytes: a stranger gets no 64 KiB buffer
            return
        try:
            for line in conn.buffer.feed(chunk):
                if conn.sock.fileno() < 0:
                    return
                self._handle(conn, decode(line))
        except (WireError, ValueError, TypeError):
            self._close(conn, lost=conn.member is not None and not conn.said_bye)

    def _send(self, conn: _Conn, message: dict[str, Any]) -> None:
        if conn.sock.fileno() < 0:
            return
        conn.pending += encode(message)
        if len(conn.pending) > _MAX_PENDING:
            self._close(conn, lost=True)
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.pending) if conn.pending else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn, lost=not conn.said_bye)
            return
        del conn.pending[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.pending else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(conn.sock, events)

    def _close(self, conn: _Conn, lost: bool) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._conns.pop(fd, None)
        for prefix in conn.prefixes:
            watching = self._watchers.get(prefix)
            if watching is not None:
                watching.pop(fd, None)
                if not watching:
                    del self._watchers[prefix]
        conn.sock.close()
        if conn.agent and conn.member is not None:  # announced by the loop: a barrier counts it as gone
            self._departed.append(("lost" if lost else "left", conn.member))

    # --- the operations --------------------------------------------------------------------------------------

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        op, reply = message.get("op"), {"re": message.get("id")}
        self.messages += 1
        if conn.member is None:
            token, member = message.get("token"), message.get("member")
            if op != "hello" or not isinstance(token, str) or not isinstance(member, str) or len(member) > 128 \
                    or not hmac.compare_digest(token.encode(), self.token.encode()):
                raise WireError("the first message is a hello with the job's token")
            conn.member, conn.agent = member, message.get("agent") is True
            self._send(conn, {**reply, "ok": True})
            return
        key = message.get("key")
        if op == "set" and isinstance(key, str):
            reply["value"] = self._set(key, message.get("value"), first=bool(message.get("first")))
        elif op == "get" and isinstance(key, str):
            reply.update(found=key in self.values, value=self.values.get(key))
        elif op == "arrive" and isinstance(key, str):
            reply["count"] = self._arrive(key, str(message.get("member")), message.get("expected"))
        elif op == "watch" and isinstance(message.get("prefix"), str):
            conn.prefixes.append(message["prefix"])
            self._watchers.setdefault(message["prefix"], {})[conn.sock.fileno()] = conn
            for name, value in list(self.values.items()):
                if name.startswith(message["prefix"]):
                    self._send(conn, {"event": "set", "key": name, "value": value})
        elif op == "bye":
            conn.said_bye = True
        elif op != "ping":
            raise WireError(f"unknown operation {op!r}")
        self._send(conn, {**reply, "ok": True})

    def _set(self, key: str, value: Any, first: bool) -> Any:
        if first and key in self.values:
            return self.values[key]
        if self.values.get(key, object()) == value:
            return value
        self.values[key] = value
        told: set[int] = set()  # a connection watching two prefixes of the key hears it once
        for prefix, watching in list(self._watchers.items()):
            if key.startswith(prefix):
                for fd, conn in list(watching.items()):
                    if fd not in told:
                        told.add(fd)
                        self._send(conn, {"event": "set", "key": key, "value": value})
        return value

    def _arrive(self, key: str, member: str, expected: Any) -> int:
        if not isinstance(expected, int) or isinstance(expected, bool) or not 0 < expected <= 10_000_000:
            raise WireError("a barrier's expected count is a positive integer")
        barrier = self._barriers.setdefault(key, _Barrier(expected))
        barrier.members.add(member)
        self._complete(key, barrier)
        return len(barrier.members)

    def _complete(self, key: str, barrier: _Barrier) -> None:
        """A barrier is decided once every expected agent arrived or is gone: its value names the gone ones
        (few), so a lost node is known within a message's time of its connection dropping."""
        if key in self.values:
            return
        gone = self._gone - barrier.members
        if len(barrier.members) + len(gone) >= barrier.expected:
            named = sorted(gone)[:_MAX_GONE_NAMED]
            self._set(key, {"arrived": len(barrier.members), "gone": named, "gone_count": len(gone),
                            "time": time.time()}, first=True)
