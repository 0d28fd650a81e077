"""The agent's Unix sockets bind under any TMPDIR, however deep."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from launch.channel import ChannelServer
from launch.socket_dirs import MAX_SOCKET_PATH, private_socket_dir


@pytest.fixture
def deep_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    return deep


def test_a_short_tmpdir_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    short = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))  # pytest's own can be too deep
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        directory = private_socket_dir("elastic-agent-", "agent.sock")
        assert Path(directory).parent == short
        assert os.stat(directory).st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(short)


def test_a_deep_tmpdir_moves_the_socket_to_tmp(deep_tmp: Path) -> None:
    directory = private_socket_dir("elastic-agent-", "agent.sock")
    try:
        path = os.path.join(directory, "agent.sock")
        assert len(path) <= MAX_SOCKET_PATH and not directory.startswith(str(deep_tmp))
        assert os.stat(directory).st_mode & 0o777 == 0o700
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def test_the_agents_channel_listens_under_a_deep_tmpdir(deep_tmp: Path) -> None:
    server = ChannelServer(lambda _c, _m: None, lambda _c: None, accept=lambda _pid: True)
    try:
        assert not server.path.startswith(str(deep_tmp))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(server.path)
    finally:
        server.close()
