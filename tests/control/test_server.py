"""The coordinator's protocol (hpc_train.control) with real sockets on the loopback and agents as threads: the
restart barrier, the first restart notice holding, a lost agent, a late one, duplicated messages, and clients
that are not the job's."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hpc_train.control.client import ControlClient, ControlError
from hpc_train.control.server import ControlServer
from hpc_train.control.wire import MAX_LINE

TOKEN = "t0ken"  # noqa: S105 (a test's token)


@pytest.fixture
def server() -> Iterator[ControlServer]:
    served = ControlServer(TOKEN, host="127.0.0.1").start()
    yield served
    served.stop()


def _agent(server: ControlServer, name: str, prefix: str = "a/") -> ControlClient:
    client = ControlClient.connect("127.0.0.1", server.port, TOKEN, name, agent=True)
    client.watch(prefix)
    client.watch("lost/")
    client.watch("left/")
    return client


def test_the_barrier_is_decided_once_every_agent_arrived_and_costs_o_n_messages(server: ControlServer) -> None:
    agents = [_agent(server, f"rank-{rank}") for rank in range(64)]
    before = server.messages
    results: list[object] = []

    def arrive(client: ControlClient, rank: int) -> None:
        client.arrive("a/ready/1", f"rank-{rank}", len(agents))
        results.append(client.wait_for("a/ready/1", 10.0))

    threads = [threading.Thread(target=arrive, args=(c, r)) for r, c in enumerate(agents)]
    for thread in threads[:-1]:
        thread.start()
    time.sleep(0.3)
    assert all(c.known.get("a/ready/1") is None for c in agents), "decided before the last agent arrived"
    threads[-1].start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(results) == 64 and all(isinstance(r, dict) and (r["arrived"], r["gone"]) == (64, []) for r in results)
    assert server.messages - before == 64  # one request per agent: O(N) in all, no polling
    for client in agents:
        client.close()


def test_the_first_restart_notice_holds_and_every_agent_hears_it(server: ControlServer) -> None:
    agents = [_agent(server, f"rank-{rank}") for rank in range(3)]
    first = agents[1].set("a/restart/1", {"rank": 1, "why": "SIGKILL"}, first=True)
    second = agents[0].set("a/restart/1", {"rank": 0, "why": "lost its peer"}, first=True)
    assert first == second == {"rank": 1, "why": "SIGKILL"}
    assert all(c.wait_for("a/restart/1", 5.0) == first for c in agents)
    late = _agent(server, "rank-3")  # an agent that watches after the fact is told what is already set
    assert late.wait_for("a/restart/1", 5.0) == first
    for client in [*agents, late]:
        client.close()


def test_a_duplicated_message_changes_nothing(server: ControlServer) -> None:
    client = _agent(server, "rank-0")
    assert client.arrive("a/ready/1", "rank-0", 2) == 1
    assert client.arrive("a/ready/1", "rank-0", 2) == 1  # the same agent twice is still one
    assert client.wait_for("a/ready/1", 0.3) is None
    other = _agent(server, "rank-1")
    assert other.arrive("a/ready/1", "rank-1", 2) == 2
    assert client.wait_for("a/ready/1", 5.0)["arrived"] == 2
    client.close()
    other.close()


def test_an_agent_that_vanishes_is_lost_and_one_that_says_bye_has_left(server: ControlServer) -> None:
    watcher = _agent(server, "rank-0")
    leaving, vanishing = _agent(server, "rank-1"), _agent(server, "rank-2")
    leaving.close()
    vanishing._sock.shutdown(socket.SHUT_RDWR)  # its host died: no bye
    assert watcher.wait_for("left/rank-1", 5.0)["member"] == "rank-1"
    assert watcher.wait_for("lost/rank-2", 5.0)["member"] == "rank-2"
    publisher = ControlClient.connect("127.0.0.1", server.port, TOKEN, "pid-5")  # a rank's one-off word
    publisher.set("a/x", 1)
    publisher._sock.shutdown(socket.SHUT_RDWR)
    time.sleep(0.3)
    assert not [k for k in watcher.known if k.endswith("pid-5")], "a publisher is no member of the job"
    watcher.close()


def test_a_lost_coordinator_breaks_the_link_at_once(server: ControlServer) -> None:
    client = _agent(server, "rank-1")
    server.stop()
    assert client.wait_for("a/restart/1", 5.0) is None and client.broken
    with pytest.raises(ControlError):
        client.get("a/restart/1")


def test_clients_that_are_not_the_jobs_are_disconnected(server: ControlServer) -> None:
    with pytest.raises(ControlError):
        ControlClient.connect("127.0.0.1", server.port, "wrong", "rank-9", agent=True)
    for junk in (b"not json\n", b"[1, 2]\n", b"x" * (MAX_LINE + 10), b'{"op": "set", "key": "a/b"}\n'):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(junk)
            sock.settimeout(5)
            try:
                answer = sock.recv(100)
            except ConnectionResetError:  # closed while bytes were still unread: also no answer
                answer = b""
            assert answer == b"", junk[:20]  # closed, no answer
    watcher = _agent(server, "rank-0")
    assert watcher.get("a/b") is None and not [k for k in watcher.known if k.startswith("lost/")]
    watcher.close()


def test_a_barrier_that_waits_for_a_lost_agent_is_decided_at_once_and_names_it(server: ControlServer) -> None:
    agents = [_agent(server, f"task-{task}@n{task // 2 + 1}") for task in range(6)]
    for task, client in enumerate(agents[:4]):
        client.arrive("a/ready/1", f"task-{task}@n{task // 2 + 1}", 6)
    assert agents[0].wait_for("a/ready/1", 0.3) is None
    agents[4]._sock.shutdown(socket.SHUT_RDWR)  # node n3 is lost: both its agents vanish
    agents[5]._sock.shutdown(socket.SHUT_RDWR)
    decided = agents[0].wait_for("a/ready/1", 5.0)
    assert decided["arrived"] == 4 and decided["gone"] == ["task-4@n3", "task-5@n3"], decided
    for client in agents[:4]:
        client.close()


def test_many_agents_gone_at_once_are_announced_in_one_round_and_the_coordinator_lives_on(
        server: ControlServer) -> None:
    """A node of many agents lost at once: every send to a dead agent fails while the others are announced; none
    of it may nest (it once ended the coordinator's thread in a RecursionError) and the watchers hear one count."""
    watcher = ControlClient.connect("127.0.0.1", server.port, TOKEN, "rank-0", agent=True)
    watcher.watch("gone")
    doomed = [_agent(server, f"task-{task}@n9") for task in range(300)]
    for client in doomed:  # their pushes of each other's departure fail: the peers are gone too
        client._sock.shutdown(socket.SHUT_RDWR)
    assert _until_count(watcher, 300)
    assert watcher.get("lost/task-299@n9")["member"] == "task-299@n9"  # the record of each, for a get
    survivor = _agent(server, "rank-1")  # the coordinator still serves
    assert survivor.arrive("a/ready/1", "rank-1", 302)  # 300 gone + 2 here: decided with rank-0's arrival
    watcher.arrive("a/ready/1", "rank-0", 302)
    assert sorted(survivor.wait_for("a/ready/1", 5.0)["gone"])[:1] == ["task-0@n9"]
    watcher.close()
    survivor.close()


def _until_count(client: ControlClient, count: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = client.known.get("gone")
        if isinstance(value, dict) and value.get("count") == count:
            return True
        time.sleep(0.02)
    return False


STRANGERS = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # the coordinator's node runs out of descriptors
from hpc_train.control.server import ControlServer
server = ControlServer("tok", host="127.0.0.1").start()
print(server.port, flush=True)
time.sleep(float(sys.argv[1]))
print("alive", server._thread.is_alive(), flush=True)
"""


def test_strangers_that_never_say_hello_are_closed_and_cannot_end_the_coordinator() -> None:
    """Any user of the cluster can connect to the port: connections without the token's hello are closed after
    5 s, and running out of descriptors pauses listening instead of ending the coordinator's thread."""
    import subprocess
    import sys

    coordinator = subprocess.Popen([sys.executable, "-c", STRANGERS, "15"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(coordinator.stdout.readline())  # type: ignore[union-attr]
        strangers = []
        for _ in range(100):  # no token, no hello: more than the coordinator has descriptors for
            with contextlib.suppress(OSError):
                strangers.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(8)  # closed after 5 s without a hello; listening resumes
        client = ControlClient.connect("127.0.0.1", port, "tok", "rank-0", agent=True, timeout_s=10, reply_s=10)
        assert client.set("a/b", 1) == 1
        client.close()
        for sock in strangers:
            sock.close()
        out, _ = coordinator.communicate(timeout=30)
        assert "alive True" in out, out
    finally:
        coordinator.kill()


class _NoScan(dict):
    """The server's connections, which a set must not look through one by one (issue 38's review: 16,384 sets at
    a save, each looking at 32,768 connections)."""

    def values(self):  # type: ignore[override]
        raise AssertionError("a set looked at every connection")

    def items(self):  # type: ignore[override]
        raise AssertionError("a set looked at every connection")


def test_a_set_reaches_its_watchers_without_looking_at_every_connection() -> None:
    import socket

    from hpc_train.control.server import _Conn
    from hpc_train.control.wire import LineBuffer, decode

    quiet = ControlServer(TOKEN, host="127.0.0.1")  # not started: its operations called directly
    pairs = [socket.socketpair() for _ in range(3)]
    conns = [_Conn(mine, member=f"m{index}") for index, (mine, _) in enumerate(pairs)]
    for conn in conns:
        quiet._conns[conn.sock.fileno()] = conn
    quiet._handle(conns[0], {"op": "watch", "prefix": "save/", "id": 1})
    quiet._handle(conns[0], {"op": "watch", "prefix": "save/written/", "id": 2})  # two prefixes: told once
    quiet._handle(conns[1], {"op": "watch", "prefix": "rank/", "id": 3})
    quiet._conns = _NoScan(quiet._conns)
    quiet._set("save/written/rank-7", {"folder": "f"}, first=False)
    for conn in conns:
        quiet._flush(conn)
    heard = []
    for _, theirs in pairs:
        theirs.setblocking(False)
        try:
            heard.append([decode(line) for line in LineBuffer().feed(theirs.recv(65536))])
        except BlockingIOError:
            heard.append([])
    events = [[m for m in messages if m.get("event") == "set"] for messages in heard]
    assert events == [[{"event": "set", "key": "save/written/rank-7", "value": {"folder": "f"}}], [], []]
    quiet._conns = dict(quiet._conns)
    quiet._close(conns[0], lost=False)
    assert "save/" not in quiet._watchers and "save/written/" not in quiet._watchers
    for mine, theirs in pairs:
        mine.close()
        theirs.close()
    quiet._listener.close()
