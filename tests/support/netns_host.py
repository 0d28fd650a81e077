"""One host of a test cluster: a network namespace with an address, its threads, its processes.

See ``tests/support/netns.py`` for the cluster around it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Final, TypeVar

from tests.support import proctree
from tests.support.netns_fabric import HOST_IFNAME
from tests.support.netns_names import NETNS_DIR, netns_inode, pids_in_netns
from tests.support.netns_threads import NetnsThreads, in_namespace
from tests.support.proctree import signal_pids

T = TypeVar("T")
_PR_SET_PDEATHSIG: Final = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
_File = int | IO[Any] | None


def _die_with_parent() -> None:
    # Between fork and exec: the kernel SIGKILLs the child when the thread that started it
    # (a namespace thread, alive until the cluster closes) or the whole test process dies.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Host:
    """A network namespace on the cluster's switch, with its own address.

    Args:
        role: ``n<i>``, ``e<i>`` or ``obs``.
        netns: the namespace's name.
        address: its IPv4 address on ``eth0``.
        port: the name of its port on the switch.
        call_timeout_s: how long :meth:`call` waits for a result.
        track: told about every process :meth:`popen` starts (the cluster kills them).

    Attributes:
        role: see above.
        name: the namespace's name (``ip netns exec NAME ...`` works too).
        address: see above.
        port: see above.
        ifname: the host's interface on the switch (``eth0``); give it to libraries that pick
            an interface, e.g. ``GLOO_SOCKET_IFNAME``.
    """

    ifname: Final = HOST_IFNAME

    def __init__(
        self,
        *,
        role: str,
        netns: str,
        address: str,
        port: str,
        call_timeout_s: float,
        track: Callable[[subprocess.Popen[Any]], None],
    ) -> None:
        self.role = role
        self.name = netns
        self.address = address
        self.port = port
        self._call_timeout_s = call_timeout_s
        self._track = track
        self._threads = NetnsThreads(str(self.netns_path), netns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, address={self.address!r})"

    @property
    def netns_path(self) -> Path:
        """The namespace's bind mount, for ``setns(2)`` or ``nsenter --net=PATH``."""
        return NETNS_DIR / self.name

    @property
    def exec_prefix(self) -> list[str]:
        """``["ip", "netns", "exec", NAME]``: put it before a command to run it here."""
        return ["ip", "netns", "exec", self.name]

    def process_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus ``GLOO_SOCKET_IFNAME=eth0`` and ``extra``.

        gloo otherwise binds the address the shared hostname resolves to, which does not
        exist inside the namespace, and falls back to the namespace's own loopback.
        """
        return {**os.environ, "GLOO_SOCKET_IFNAME": self.ifname, **(extra or {})}

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Starts ``fn(*args, **kwargs)`` on a thread inside this namespace; see :meth:`call`."""
        return self._threads.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Runs ``fn(*args, **kwargs)`` on a thread inside this namespace and returns its result.

        Sockets it creates belong to this namespace for their whole life (they can later be
        used from any thread); threads and processes it starts are born here. Works whatever
        faults the switch has: it is the test process entering the namespace, not traffic.

        Raises:
            TimeoutError: when ``fn`` has not returned within the cluster's ``call_timeout_s``
                (use :meth:`submit` to wait longer); ``fn`` keeps running.
            Exception: whatever ``fn`` raised.
        """
        future = self.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self._call_timeout_s)
        except FutureTimeoutError:
            raise TimeoutError(
                f"{getattr(fn, '__qualname__', fn)} did not return within "
                f"{self._call_timeout_s:g} s inside namespace {self.name}; use submit() "
                "to wait longer."
            ) from None

    def proxy(self, target: T) -> T:
        """``target`` with every method call made through :meth:`call` (e.g. an etcd client).

        Attributes that are not methods are read on the caller's thread.
        """
        return in_namespace(self.call, target)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stdin: _File = subprocess.DEVNULL,
        stdout: _File = None,
        stderr: _File = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside this namespace, in a new session, tracked by the cluster.

        The returned ``Popen``'s PID is the program's own (no wrapper), the process leads its
        own session and process group, and the kernel SIGKILLs it if the test process dies.
        The cluster kills its tree (and anything else left in the namespace) when it closes.

        Args:
            argv: the program and its arguments.
            env: its environment (this process's when ``None``).
            cwd: its working directory.
            stdin: as for :class:`subprocess.Popen` (``DEVNULL`` by default).
            stdout: as for :class:`subprocess.Popen`.
            stderr: as for :class:`subprocess.Popen`.
            **popen_kwargs: more :class:`subprocess.Popen` arguments (``text=True``, ...).
        """
        proc: subprocess.Popen[Any] = self.call(
            subprocess.Popen, list(argv), env=None if env is None else dict(env), cwd=cwd,
            stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True,
            preexec_fn=_die_with_parent, **popen_kwargs,
        )
        self._track(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = True,
        **run_kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` to completion inside this namespace, capturing its text output.

        Raises:
            subprocess.CalledProcessError: when it fails and ``check`` is true.
            subprocess.TimeoutExpired: after ``timeout_s``.
        """
        return self.call(subprocess.run, list(argv), capture_output=True, text=True,
                         timeout=timeout_s, check=check, **run_kwargs)

    def pids(self) -> list[int]:
        """Every process inside this namespace, whatever started it."""
        inode = netns_inode(self.name)
        return pids_in_netns({inode}) if inode is not None else []

    def workers(self, agent_pid: int) -> list[int]:
        """The worker processes of the agent ``agent_pid``: its live children but waiting
        standbys, oldest first."""
        return proctree.workers(agent_pid)

    def kill_all(self, sig: signal.Signals = signal.SIGKILL) -> list[int]:
        """Sends ``sig`` to every process inside this namespace; returns their PIDs."""
        pids = self.pids()
        signal_pids(pids, sig)
        return pids

    def close_threads(self, timeout_s: float = 10.0) -> list[str]:
        """Stops this host's threads; returns those still busy in a call."""
        return self._threads.close(timeout_s)


class EtcdMember(Host):
    """A host running one etcd member (``launch.etcd_server.EmbeddedEtcd``) on its address.

    Every method that starts etcd or probes its health runs on this host's threads, so the
    member binds and answers inside the namespace; :attr:`server` is the ``EmbeddedEtcd``.
    """

    CLIENT_PORT: Final = 2379
    PEER_PORT: Final = 2380

    def __init__(self, *, binary: str, member_name: str, cluster: str, data_dir: str,
                 **host_kwargs: Any) -> None:
        super().__init__(**host_kwargs)
        from launch.etcd_server import EmbeddedEtcd

        self.server = EmbeddedEtcd(binary=binary, host=self.address, name=member_name,
                                   client_port=self.CLIENT_PORT, peer_port=self.PEER_PORT,
                                   cluster=cluster, data_dir=data_dir)

    @property
    def endpoint(self) -> str:
        """``address:2379``, the member's client endpoint."""
        return self.server.endpoint

    @property
    def peer_url(self) -> str:
        """``http://address:2380``."""
        return self.server.peer_url

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or ``None``."""
        return self.server.pid

    def launch(self) -> None:
        """Starts etcd without waiting for it to be healthy."""
        self.call(self.server.launch)

    def wait_healthy(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Waits until the member answers ``/health`` (it needs a quorum first)."""
        self.submit(self.server.wait_healthy, timeout).result(timeout.total_seconds() + 10)

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Starts etcd and waits until it is healthy."""
        self.launch()
        self.wait_healthy(timeout)

    def restart(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """SIGKILLs etcd and starts it again with the same data."""
        self.kill()
        self.start(timeout)

    def kill(self) -> None:
        """SIGKILLs etcd (its data stays)."""
        self.server.kill()

    def pause(self) -> None:
        """SIGSTOPs etcd: its sockets stay open and it answers nothing."""
        self.server.pause()

    def resume(self) -> None:
        """SIGCONTs a paused etcd."""
        self.server.resume()

    def stop(self) -> None:
        """Stops etcd (SIGTERM, then SIGKILL); its data stays until the cluster closes."""
        self.server.stop()
