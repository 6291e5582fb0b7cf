"""ringserve.process.free_port: never the same port twice in one process."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from ringserve import process


def test_free_port_skips_a_port_already_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may answer two binds to port 0 with the same port once the first socket closed
    # (what put the detokenizer's metrics and the gateway on one port in a CI run); replay that.
    answers = iter([41000, 41000, 41001])

    class FakeSocket:
        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(answers)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(process, "_handed_out", set())
    monkeypatch.setattr(process.socket, "socket", lambda *a, **k: FakeSocket())
    assert [process.free_port(), process.free_port()] == [41000, 41001]


def test_free_port_is_bindable() -> None:
    port = process.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
