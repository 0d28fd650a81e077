"""Private directories for the agent's Unix sockets, short enough for any ``TMPDIR``.

A Unix socket's path must fit ``sun_path`` (108 bytes on Linux, its NUL included). A deep
``TMPDIR`` (a test's temporary directory, a container's scratch mount) would make ``bind``
fail with "AF_UNIX path too long", so such a directory goes under ``/tmp`` instead.
"""

from __future__ import annotations

import os
import tempfile
from typing import Final

__all__ = ["private_socket_dir"]

#: The longest socket path used: leaves room in ``sun_path`` for the NUL and some slack.
MAX_SOCKET_PATH: Final = 100
_SUFFIX_LEN: Final = 8  # what mkdtemp appends to the prefix


def private_socket_dir(prefix: str, socket_name: str) -> str:
    """Creates a private directory (mode 0700) that will hold the socket ``socket_name``.

    Args:
        prefix: The directory name's prefix (``elastic-agent-``).
        socket_name: The file name of the socket that goes in it.

    Returns:
        The directory: under the temporary directory, or under ``/tmp`` when the socket's
        path would not fit a Unix socket's address there.
    """
    longest = os.path.join(tempfile.gettempdir(), prefix + "x" * _SUFFIX_LEN, socket_name)
    parent = None if len(os.fsencode(longest)) <= MAX_SOCKET_PATH else "/tmp"
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(directory, 0o700)
    return directory
