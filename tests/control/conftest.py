"""A job's coordinator on this machine for a test, named to the test's process as an agent names it to a rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hpc_train.control.discovery import Address
from hpc_train.control.server import ControlServer


@pytest.fixture
def coordinator(monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlServer]:
    server = ControlServer("secret-of-this-test", host="127.0.0.1").start()
    for name, value in Address("127.0.0.1", server.port, server.token).environment().items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()
