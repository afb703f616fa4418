"""The tests' own harness (tests/support.py): a `Server` whose port, picked by `free_port`, was bound by another
process before the server bound it (on a busy CI machine, another test's listener) starts again on another port
instead of failing the test; a port the test chose itself is not changed behind its back."""
from __future__ import annotations

import os
import socket

import pytest

from tests import support


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, monkeypatch):
    with _held_port() as held:
        taken = held.getsockname()[1]
        picks = [taken]
        real = support.free_port
        monkeypatch.setattr(support, "free_port", lambda: picks.pop() if picks else real())
        with support.Server(str(tmp_path)) as server:
            assert server.port != taken
            with open(os.path.join(str(tmp_path), f"server_{taken}.log")) as fh:
                assert "cannot bind" in fh.read()          # the first start found it taken
            assert f"server_{server.port}.json" in server.config
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", server.port)) == 0   # it serves on the port picked again
            assert server.stop() == 0


def test_a_port_the_test_chose_is_kept_and_its_failure_reported(tmp_path):
    with _held_port() as held:
        taken = held.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot bind"):
            support.Server(str(tmp_path), port=taken).start()
