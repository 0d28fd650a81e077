"""The agent's side of worker telemetry, and the node's telemetry as one component.

:class:`TelemetryReceiver` binds a Unix datagram socket in a private (0700) directory and hands
every record its workers send (:mod:`elastic.telemetry`) to a callback from a daemon thread.
:class:`NodeTelemetry` is what an agent runs: the receiver feeding the agent's own event log
(so that the workers' durable records reach the job log), plus, with a metrics port, the
node's Prometheus series (:class:`launch.metrics.NodeMetrics`) as one more sink of that log,
served at ``/metrics``. Wiring it into an agent::

    telemetry = NodeTelemetry(events, metrics_port=args.metrics_port,
                              metrics_host=args.metrics_host).start()
    os.environ.update(telemetry.worker_env)   # before the workers start
    ...
    telemetry.close(); events.close()         # at the agent's exit
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from elastic import env
from elastic.event_chunks import ChunkWriter
from elastic.eventlog import EventLog
from elastic.telemetry import MAX_DATAGRAM, Datagram, decode_all
from launch.socket_dirs import private_socket_dir

if TYPE_CHECKING:
    from launch.metrics import NodeMetrics

logger = logging.getLogger(__name__)

SOCKET_NAME: Final = "telemetry.sock"
#: Time between two passes of the receiver over its socket.
_POLL_S: Final = 0.05
#: Receive buffer asked for: room for bursts while the receiver thread waits for the GIL.
_RCVBUF: Final = 4 << 20


class TelemetryReceiver:
    """Receives worker records on a Unix datagram socket and passes them to ``deliver``.

    Args:
        deliver: Called with each record and its durable flag, on the receiver thread; it must
            not block for long (the workers' datagrams queue meanwhile, up to the kernel's
            limit, then wait in the workers' backlogs).
        deliver_many: Called instead of ``deliver`` with every record of one pass over the
            socket, ``(record, durable)`` oldest first, where one call for the lot is cheaper.
    """

    def __init__(self, deliver: Callable[[dict[str, Any], bool], None], *,
                 deliver_many: Callable[[list[tuple[dict[str, Any], bool]]], None] | None = None,
                 ) -> None:
        self._deliver = deliver
        self._deliver_many = deliver_many
        self._dir: str | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._dropped_by_pid: dict[int, int] = {}
        #: Records received so far.
        self.received = 0

    @property
    def path(self) -> str:
        """The socket's path (for ``ELASTIC_TELEMETRY_SOCKET``)."""
        if self._dir is None:
            raise RuntimeError("the telemetry receiver is not started")
        return os.path.join(self._dir, SOCKET_NAME)

    @property
    def dropped(self) -> int:
        """Records the workers reported dropped (their counts at their last datagram)."""
        return sum(self._dropped_by_pid.values())

    def start(self) -> TelemetryReceiver:
        """Binds the socket and starts the receiver thread."""
        self._dir = private_socket_dir("elastic-telemetry-", SOCKET_NAME)
        atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):  # capped by net.core.rmem_max: best effort
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        sock.bind(self.path)
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="telemetry-receiver",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the thread, closes the socket and removes its directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            # What the workers sent just before they exited is still queued: take it.
            payloads: list[bytes] = []
            with contextlib.suppress(OSError):
                while True:
                    payloads.append(self._sock.recv(MAX_DATAGRAM + 1024))
            self._handle(payloads)
            self._sock.close()
            self._sock = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        size = MAX_DATAGRAM + 1024
        # Polled, not waited on: a worker's send then never has a sleeping reader to wake (a
        # wake-up costs the sender more than the send itself), and the receiver handles a
        # burst of records per pass. The kernel queues 10 datagrams by default, so a pass every
        # 50 ms takes 200 records/s before the workers keep any in their backlogs.
        while not self._stop.wait(_POLL_S):
            payloads: list[bytes] = []
            try:
                while len(payloads) < 1024:
                    payloads.append(sock.recv(size))
            except BlockingIOError:
                pass
            except OSError:
                if self._stop.is_set():
                    return
                logger.exception("The telemetry socket failed; worker records are off.")
                return
            if payloads:
                self._handle(payloads)

    def _handle(self, payloads: list[bytes]) -> None:
        datagrams: list[Datagram] = []
        for payload in payloads:
            decoded = decode_all(payload)
            if not decoded:
                logger.debug("Ignoring a datagram that is not telemetry (%d bytes).",
                             len(payload))
            datagrams += decoded
        if not datagrams:
            return
        self.received += len(datagrams)
        for datagram in datagrams:
            if datagram.pid >= 0:
                self._dropped_by_pid[datagram.pid] = datagram.dropped
        if self._deliver_many is not None:
            try:
                self._deliver_many([(d.record, d.durable) for d in datagrams])
            except Exception:  # one bad batch must not end the receiver
                logger.exception("Delivering %d records failed.", len(datagrams))
            return
        for datagram in datagrams:
            try:
                self._deliver(datagram.record, datagram.durable)
            except Exception:  # one bad record must not end the receiver
                logger.exception("Delivering a %s record failed.",
                                 datagram.record.get("event"))


class NodeTelemetry:
    """A node agent's telemetry: its workers' socket and, optionally, its metrics endpoint.

    Args:
        events: The agent's event log; the workers' records are passed to it, and the metrics
            registry becomes one of its sinks.
        metrics_port: Serve ``/metrics`` on this port (0: any free one); ``None``: no metrics.
        metrics_host: Address to bind (default every interface).
    """

    def __init__(self, events: EventLog, *, metrics_port: int | None = None,
                 metrics_host: str = "") -> None:
        self.events = events
        self._port = metrics_port
        self._host = metrics_host
        self.metrics: NodeMetrics | None = None
        self.receiver: TelemetryReceiver | None = None
        #: The bound metrics port once serving.
        self.metrics_port: int | None = None

    @property
    def worker_env(self) -> dict[str, str]:
        """Environment for the node's workers (empty when nothing listens)."""
        return {} if self.receiver is None else {env.TELEMETRY_SOCKET: self.receiver.path}

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:PORT/metrics`` of this node (for ``elastic-run status``), if serving."""
        if self.metrics_port is None:
            return None
        host = self._host if self._host not in ("", "0.0.0.0", "::") else socket.getfqdn()
        return f"http://{host}:{self.metrics_port}/metrics"

    def start(self) -> NodeTelemetry:
        """Starts the metrics endpoint (if asked) and the receiver (if anything listens).

        Raises:
            ConfigError: the metrics port cannot be bound.
        """
        if self._port is not None:
            from launch.metrics import NodeMetrics

            metrics = NodeMetrics(job=self.events.job, node=self.events.node)
            self.metrics_port = metrics.serve(self._port, self._host)
            self.metrics = metrics
            self.events.add_sink(metrics)
        if self.events.enabled:
            self.receiver = TelemetryReceiver(self._deliver,
                                              deliver_many=self.events.emit_many).start()
        if self.metrics is not None:
            receiver = self.receiver
            self.metrics.add_drop_source("telemetry",
                                         lambda: 0 if receiver is None else receiver.dropped)
            self.metrics.add_drop_source("event_log", self._log_drops)
        return self

    def close(self) -> None:
        """Stops the receiver and the endpoint (the event log stays open)."""
        if self.receiver is not None:
            self.receiver.stop()
        if self.metrics is not None:
            self.metrics.close(0.0)

    def __enter__(self) -> NodeTelemetry:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _deliver(self, record: dict[str, Any], durable: bool) -> None:
        self.events.emit(record, durable=durable)

    def _log_drops(self) -> int:
        return sum(s.dropped for s in self.events.sinks if isinstance(s, ChunkWriter))
