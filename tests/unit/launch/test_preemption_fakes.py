"""Fake cloud metadata servers (AWS IMDSv2, GCP, Azure Scheduled Events) on 127.0.0.1.

Each is a real HTTP server on an ephemeral port in a daemon thread; tests flip its state to
announce a preemption and read back what requests it saw.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class FakeState:
    """Mutable state the fake servers answer from."""

    preempted: bool = False
    # AWS
    tokens: set[str] = field(default_factory=set)
    token_count: int = 0
    action_time: str = "2030-01-01T00:02:00Z"
    # GCP: how long a wait_for_change request is held before answering unchanged
    hang_s: float = 0.0
    long_polls: int = 0
    # Azure
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def preempt(self) -> None:
        with self.changed:
            self.preempted = True
            self.changed.notify_all()


class _Handler(BaseHTTPRequestHandler):
    state: FakeState
    cloud: str

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: str, headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> tuple[str, dict[str, list[str]]]:
        url = urlsplit(self.path)
        self.state.requests.append((self.command, url.path, dict(self.headers.items())))
        return url.path, parse_qs(url.query)

    def do_PUT(self) -> None:
        path, _ = self._record()
        if self.cloud == "aws" and path == "/latest/api/token":
            if "X-aws-ec2-metadata-token-ttl-seconds" not in self.headers:
                self._reply(400, "missing TTL")
                return
            self.state.token_count += 1
            token = f"token-{self.state.token_count}"
            self.state.tokens.add(token)
            self._reply(200, token)
            return
        self._reply(404, "")

    def do_GET(self) -> None:
        path, query = self._record()
        getattr(self, f"_get_{self.cloud}")(path, query)

    def _get_aws(self, path: str, query: dict[str, list[str]]) -> None:
        if path != "/latest/meta-data/spot/instance-action":
            self._reply(404, "")
        elif self.headers.get("X-aws-ec2-metadata-token") not in self.state.tokens:
            self._reply(401, "")
        elif not self.state.preempted:
            self._reply(404, "Not Found")
        else:
            body = {"action": "terminate", "time": self.state.action_time}
            self._reply(200, json.dumps(body))

    def _get_gcp(self, path: str, query: dict[str, list[str]]) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._reply(403, "missing Metadata-Flavor")
            return
        if path != "/computeMetadata/v1/instance/preempted":
            self._reply(404, "")
            return
        if query.get("wait_for_change") == ["true"]:
            self.state.long_polls += 1
            timeout = min(float(query.get("timeout_sec", ["60"])[0]), 60.0)
            wait = self.state.hang_s or timeout
            end = time.monotonic() + wait
            with self.state.changed:
                while not self.state.preempted and time.monotonic() < end:
                    self.state.changed.wait(end - time.monotonic())
        value = "TRUE" if self.state.preempted else "FALSE"
        self._reply(200, value, {"Metadata-Flavor": "Google", "ETag": f"etag-{value}"})

    def _get_azure(self, path: str, query: dict[str, list[str]]) -> None:
        if self.headers.get("Metadata") != "true":
            self._reply(400, "missing Metadata header")
        elif path != "/metadata/scheduledevents" or query.get("api-version") != ["2020-07-01"]:
            self._reply(404, "")
        else:
            self._reply(200, json.dumps({"DocumentIncarnation": 1, "Events": self.state.events}))


@contextmanager
def serve(cloud: str, state: FakeState | None = None) -> Iterator[tuple[str, FakeState]]:
    """Serve the fake for ``cloud`` (``aws``, ``gcp``, ``azure``); yields (base URL, state)."""
    state = state or FakeState()
    handler = type("Handler", (_Handler,), {"state": state, "cloud": cloud})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        with state.changed:
            state.preempted = state.preempted  # wake nothing; long polls end by their timeout
        server.shutdown()
        server.server_close()
        thread.join(5)
