"""Rank states between nodes' memory over the agents' TCP server: a replica pushed and fetched back byte for byte,
and what is refused (no token, a name that climbs out, a step not held)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import pytest

from hpc_train.checkpoint import memory_transfer
from hpc_train.checkpoint.memory_store import NodeStore
from hpc_train.checkpoint.memory_transfer import MemoryServer, TransferError, fetch_step, push_step, step_files

TOKEN = "0123456789abcdef0123456789abcdef"  # noqa: S105 (a test's token)


@pytest.fixture
def served(tmp_path: Path) -> tuple[NodeStore, str]:
    (tmp_path / "b").mkdir()
    store = NodeStore.create("9", 1, base=tmp_path / "b")
    server = MemoryServer(store, TOKEN, host="127.0.0.1").start()
    yield store, f"127.0.0.1:{server.port}"
    server.stop()


def _own_step(tmp_path: Path) -> tuple[NodeStore, Path]:
    (tmp_path / "a").mkdir()
    store = NodeStore.create("9", 0, base=tmp_path / "a")
    tmp = store.begin("own", 3, (20, 0))
    (tmp / "ds").mkdir()
    (tmp / "ds" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").write_bytes(bytes(range(256)) * 4000)
    (tmp / "rng.pt").write_bytes(b"rng")
    (tmp / "files.json").write_text("{}")
    return store, store.seal(tmp, (20, 0))


def test_a_replica_is_pushed_then_fetched_back_byte_for_byte(tmp_path: Path, served: tuple[NodeStore, str]) -> None:
    holder, address = served
    _store, folder = _own_step(tmp_path)
    push_step(address, TOKEN, folder, 3, (20, 0))
    assert holder.holdings() == {3: [(20, 0)]}
    assert step_files(holder.find(3, (20, 0))) == step_files(folder)
    (tmp_path / "c").mkdir()
    fresh = NodeStore.create("9", 2, base=tmp_path / "c")
    fetched = fetch_step(address, TOKEN, 3, (20, 0), fresh)
    assert fetched == fresh.rank_dir("fetched", 3) / "step-20.0"
    for name, _size in step_files(folder):
        assert (fetched / name).read_bytes() == (folder / name).read_bytes()


def test_a_wrong_token_is_refused_and_nothing_is_written(tmp_path: Path, served: tuple[NodeStore, str]) -> None:
    holder, address = served
    _store, folder = _own_step(tmp_path)
    with pytest.raises(TransferError, match="token"):
        push_step(address, "not-the-token", folder, 3, (20, 0))
    assert holder.holdings() == {}


def test_a_step_not_held_is_refused_and_leaves_nothing_half_fetched(tmp_path: Path,
                                                                    served: tuple[NodeStore, str]) -> None:
    _holder, address = served
    (tmp_path / "c").mkdir()
    fresh = NodeStore.create("9", 2, base=tmp_path / "c")
    with pytest.raises(TransferError, match="not held here"):
        fetch_step(address, TOKEN, 3, (20, 0), fresh)
    assert not list(fresh.rank_dir("fetched", 3).iterdir())


@pytest.mark.parametrize("name", ["../escape.pt", "/etc/passwd", "a/../../b", "", "a//b"])
def test_a_name_that_is_not_a_plain_relative_path_is_refused(served: tuple[NodeStore, str], name: str) -> None:
    holder, address = served
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(json.dumps({"token": TOKEN, "op": "put", "rank": 0, "step": 1, "life": 0,
                                "files": [[name, 1]]}).encode()
                     + b"\nx")
        answer = json.loads(sock.makefile().readline())
    assert "plain relative path" in answer["error"]
    assert holder.holdings() == {}
    assert not (holder.root.parent / "escape.pt").exists()


def test_an_unreachable_peer_is_a_transfer_error(tmp_path: Path) -> None:
    _store, folder = _own_step(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransferError, match="cannot be reached"):
        push_step(f"127.0.0.1:{port}", TOKEN, folder, 3, (20, 0))


def test_a_request_line_that_trickles_in_is_cut_at_its_deadline(served: tuple[NodeStore, str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that sends a byte now and then holds a slot no longer than the whole line's deadline."""
    monkeypatch.setattr(memory_transfer, "_HEADER_S", 0.5)
    _holder, address = served
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        started = time.monotonic()
        for _ in range(8):
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
            time.sleep(0.1)
        answer = sock.makefile().readline()
    assert "no whole request line within" in answer and time.monotonic() - started < 5
