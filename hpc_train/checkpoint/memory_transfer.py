"""Rank states between nodes' memory (:mod:`hpc_train.checkpoint.memory_store`): each node's agent serves its folder
over TCP, so that another node's agent can push a replica into it and a rank that moved (a spare took its node's
place) can fetch its state from the node that holds the replica.

One request per connection: a JSON line (the job's token, checked in constant time; ``put`` or ``get``; the rank,
step and life). A ``put`` is answered ``ready`` (or the refusal), then its files' bytes follow back to back, as the line
listed them, and the last answer says they are held; a ``get`` is answered with the list, then the bytes.
File names are checked (relative, plain names, no ``..``) before anything is created; a ``put`` bigger than half
the memory the node still has is refused (the sender logs it and the restart reads the disk checkpoint). Standard
library only: the agent serves it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.memory_store import KEPT_STEPS, Copy, NodeStore, available_memory

__all__ = ["MemoryServer", "TransferError", "fetch_step", "push_step", "step_files"]

log = logging.getLogger(__name__)

_MAX_HEADER = 64 * 1024  # a request's line: a step's file list is a few hundred bytes
_HEADER_S = 5.0  # a request's whole first line comes within this (not each byte of it)
_MAX_CONNECTIONS = 64  # requests served at once (a node's agents push one copy at a time per rank)
_TIMEOUT_S = 120.0  # one step's files at memory and network speed; a peer silent this long is given up
_CHUNK = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_MEMORY_SHARE = 0.5


class TransferError(Exception):
    """A transfer failed: refused, a peer gone, a bad request."""


def _safe_relative(name: Any) -> str:
    """``name`` as a relative path of plain components; raises on anything else (``..``, absolute, odd)."""
    if not isinstance(name, str):
        raise TransferError(f"a file name that is not a string: {name!r}")
    parts = name.split("/")
    if not 1 <= len(parts) <= 4 or any(p in (".", "..") or not _NAME.fullmatch(p) for p in parts):
        raise TransferError(f"a file name that is not a plain relative path: {name!r}")
    return name


def step_files(folder: Path) -> list[tuple[str, int]]:
    """Every regular file below ``folder`` (links skipped), as (relative name, size), sorted."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        found.append((path.relative_to(folder).as_posix(), path.stat().st_size))
    return found


def _read_line(sock: socket.socket, within_s: float | None = None) -> dict[str, Any]:
    """One JSON line, read a byte at a time (what follows it is the files' bytes); within ``within_s`` in all."""
    data = bytearray()
    deadline = None if within_s is None else time.monotonic() + within_s
    while not data.endswith(b"\n"):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"no whole request line within {within_s:g} s")
            sock.settimeout(left)
        try:
            chunk = sock.recv(1)
        except TimeoutError as error:
            raise TransferError(f"no whole request line within {within_s or _TIMEOUT_S:g} s") from error
        if not chunk:
            raise TransferError("the peer closed the connection")
        data += chunk
        if len(data) > _MAX_HEADER:
            raise TransferError("a request line over 64 KiB")
    value = json.loads(data)
    if not isinstance(value, dict):
        raise TransferError("a request that is not a JSON object")
    return value


def _send_line(sock: socket.socket, value: dict[str, Any]) -> None:
    sock.sendall(json.dumps(value).encode() + b"\n")


def _send_files(sock: socket.socket, folder: Path, files: list[tuple[str, int]]) -> None:
    for name, size in files:
        with open(folder / name, "rb") as source:
            sent = sock.sendfile(source, 0, size)
        if sent != size:
            raise TransferError(f"{name} changed size while being sent")


def _receive_files(sock: socket.socket, folder: Path, files: list[tuple[str, int]]) -> None:
    for name, size in files:
        path = folder / name
        below = folder
        for part in name.split("/")[:-1]:  # the folders inside ``folder`` only: never ``folder`` or above it
            below = below / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(below, 0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            left = size
            while left:
                chunk = sock.recv(min(_CHUNK, left))
                if not chunk:
                    raise TransferError(f"the peer closed the connection in the middle of {name}")
                out.write(chunk)
                left -= len(chunk)


def _listed(value: Any) -> list[tuple[str, int]]:
    if not isinstance(value, list) or len(value) > 10_000:
        raise TransferError("a file list that is not a list of at most 10,000 entries")
    files = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and item[1] >= 0):
            raise TransferError(f"a file entry that is not [name, size]: {item!r}")
        files.append((_safe_relative(item[0]), item[1]))
    return files


def _rank_copy(request: dict[str, Any]) -> tuple[int, Copy]:
    rank, step, life = request.get("rank"), request.get("step"), request.get("life")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, step, life)) or \
            not (0 <= rank < 1 << 24 and 0 <= step < 1 << 50 and 0 <= life < 1 << 20):
        raise TransferError("a request without a valid rank, step and life")
    return rank, (step, life)


class MemoryServer:
    """Serves a node's :class:`NodeStore` to the job's other agents and ranks (see the module's docstring)."""

    def __init__(self, store: NodeStore, token: str, host: str = "") -> None:
        self.store, self.token = store, token
        self.sock = socket.create_server((host, 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        self._stopped = False
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._serve, name="memory-tier-server", daemon=True)

    def start(self) -> MemoryServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a flood of connections: the newest is closed at once
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), name="memory-tier-request", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = _read_line(conn, within_s=_HEADER_S)  # one that says nothing holds no thread for long
                conn.settimeout(_TIMEOUT_S)
                if self._stopped:
                    raise TransferError("the agent is ending")
                if not hmac.compare_digest(str(request.get("token", "")).encode(), self.token.encode()):
                    raise TransferError("a request without the job's token")
                if request.get("op") == "put":
                    self._put(conn, request)
                elif request.get("op") == "get":
                    self._get(conn, request)
                else:
                    raise TransferError(f"an unknown operation {request.get('op')!r}")
            except (TransferError, OSError, ValueError, RecursionError) as error:
                log.warning("memory tier: a request refused: %s", error)
                with contextlib.suppress(OSError):
                    _send_line(conn, {"error": str(error)})
            finally:
                self._slots.release()

    def _put(self, conn: socket.socket, request: dict[str, Any]) -> None:
        rank, copy = _rank_copy(request)
        files = _listed(request.get("files"))
        total, available = sum(size for _, size in files), available_memory()
        if available is not None and total > available * _MEMORY_SHARE:
            raise TransferError(f"no room for rank {rank}'s step {copy[0]}: {total / 1e9:.2f} GB, "
                                f"{available / 1e9:.2f} GB of memory available on this node")
        tmp = self.store.begin("replica", rank, copy)
        try:
            _send_line(conn, {"ready": True})  # the sender sends the bytes only once the header is accepted
            _receive_files(conn, tmp, files)
            self.store.seal(tmp, copy)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.store.prune("replica", rank, KEPT_STEPS)
        _send_line(conn, {"ok": True})

    def _get(self, conn: socket.socket, request: dict[str, Any]) -> None:
        rank, copy = _rank_copy(request)
        folder = self.store.find(rank, copy)
        if folder is None:
            raise TransferError(f"rank {rank}'s step {copy[0]} (life {copy[1]}) is not held here")
        files = step_files(folder)
        _send_line(conn, {"files": [[name, size] for name, size in files]})
        _send_files(conn, folder, files)
        _send_line(conn, {"ok": True})  # the bytes came whole: a failure half way never reads as content


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"not an address: {address!r}")
    try:
        return socket.create_connection((host, int(port)), timeout=_TIMEOUT_S)
    except OSError as error:
        raise TransferError(f"{address} cannot be reached: {error}") from error


def push_step(address: str, token: str, folder: Path, rank: int, copy: Copy) -> None:
    """Copy the sealed ``folder`` (rank ``rank``'s ``copy``) into the memory of the agent at ``address``."""
    files = step_files(folder)
    try:
        with _connect(address) as sock:
            _send_line(sock, {"token": token, "op": "put", "rank": rank, "step": copy[0], "life": copy[1],
                              "files": [[name, size] for name, size in files]})
            answer = _read_line(sock)
            if answer.get("ready"):
                _send_files(sock, folder, files)
                answer = _read_line(sock)
    except OSError as error:
        raise TransferError(f"pushing to {address}: {error}") from error
    if not answer.get("ok"):
        raise TransferError(str(answer.get("error", "refused")))


def fetch_step(address: str, token: str, rank: int, copy: Copy, store: NodeStore) -> Path:
    """Fetch rank ``rank``'s ``copy`` from the agent at ``address`` into this node's ``fetched/``; the sealed
    folder."""
    try:
        tmp = store.begin("fetched", rank, copy)
    except OSError as error:
        raise TransferError(f"no folder for it on this node: {error}") from error
    try:
        with _connect(address) as sock:
            _send_line(sock, {"token": token, "op": "get", "rank": rank, "step": copy[0], "life": copy[1]})
            answer = _read_line(sock)
            if "error" in answer:
                raise TransferError(str(answer["error"]))
            _receive_files(sock, tmp, _listed(answer.get("files")))
            if not _read_line(sock).get("ok"):
                raise TransferError("the holder did not send the copy whole")
        return store.seal(tmp, copy)
    except (OSError, ValueError, RecursionError, TransferError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, TransferError):
            raise
        raise TransferError(f"fetching from {address}: {error}") from error
