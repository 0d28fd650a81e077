"""moto's S3 server on 127.0.0.1 for tests, with dummy credentials in the environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_s3() -> Iterator[str]:
    """Runs moto's threaded S3 server on a free port; yields its endpoint URL.

    The credentials it accepts are set in ``os.environ`` meanwhile (child processes inherit
    them) and restored afterwards.
    """
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _CREDENTIALS}
    os.environ.update(_CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs ``storage_options`` for the server at ``endpoint``."""
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": "x", "secret": "x"}
