"""A stand-in training worker for the hang-file test: a heartbeat thread and a step loop.

Usage: ``heartbeat_worker.py OUT_DIR``. The heartbeat thread writes its beat count to
``OUT_DIR/beats`` every 20 ms; the main loop calls ``maybe_hang()`` where a real worker would
enter its collective, then writes its step count to ``OUT_DIR/steps``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from tests.support.hang import maybe_hang


def _write(path: Path, value: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(value))
    tmp.replace(path)


def _heartbeat(out: Path) -> None:
    beats = 0
    while True:
        beats += 1
        _write(out / "beats", beats)
        time.sleep(0.02)


def main() -> None:
    out = Path(sys.argv[1])
    threading.Thread(target=_heartbeat, args=(out,), daemon=True).start()
    step = 0
    while True:
        maybe_hang()
        step += 1
        _write(out / "steps", step)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
