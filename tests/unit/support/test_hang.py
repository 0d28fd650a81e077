"""The hang-file convention: parsing, the writers, and maybe_hang in this process."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support import hang


def test_the_file_names_pids_and_star_separated_by_blanks_or_commas() -> None:
    assert hang.parse_targets("12\n 34,56\t*\n") == {"12", "34", "56", "*"}
    assert hang.parse_targets("") == frozenset()


@pytest.mark.parametrize("text", ["12 abc", "-3", "0", "12;13"])
def test_a_token_that_is_no_pid_is_named_in_the_error(text: str) -> None:
    with pytest.raises(ValueError, match="neither a PID nor"):
        hang.parse_targets(text)


def test_writers_add_and_remove_pids_and_remove_the_file_when_empty(tmp_path: Path) -> None:
    path = tmp_path / "hang"
    hang.hang_worker(path, 11)
    hang.hang_worker(path, 12)
    assert hang.targets(path, 11) and hang.targets(path, 12) and not hang.targets(path, 13)
    hang.release_worker(path, 11)
    assert not hang.targets(path, 11) and hang.targets(path, 12)
    hang.hang_all(path)
    assert hang.targets(path, 13)
    hang.release_worker(path, 12)
    assert hang.targets(path, 12)  # '*' still names it
    hang.release_all(path)
    assert not path.exists() and not hang.targets(path, 12)
    hang.hang_worker(path, 5)
    hang.release_worker(path, 5)
    assert not path.exists()
    with pytest.raises(ValueError, match=r"worker pid \(0\)"):
        hang.hang_worker(path, 0)


def test_maybe_hang_returns_at_once_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hang.HANG_FILE_ENV, raising=False)
    assert hang.maybe_hang() == 0.0


def test_maybe_hang_holds_this_process_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    path = tmp_path / "hang"
    monkeypatch.setenv(hang.HANG_FILE_ENV, str(path))
    monkeypatch.setattr(hang, "_next_check", 0.0)
    assert hang.maybe_hang() == 0.0  # no file yet
    hang.hang_worker(path, os.getpid())
    time.sleep(hang.POLL_S)  # past the rate limit of the previous look
    held: list[float] = []
    worker = threading.Thread(target=lambda: held.append(hang.maybe_hang()))
    worker.start()
    hang.wait_hung(path, os.getpid(), timeout_s=5)
    time.sleep(0.2)
    assert worker.is_alive()
    hang.release_worker(path, os.getpid())
    worker.join(5)
    assert not worker.is_alive() and held[0] >= 0.2
    assert not hang.is_hung(path, os.getpid())


def test_wait_hung_names_the_worker_when_it_never_hangs(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="worker 77 did not reach maybe_hang"):
        hang.wait_hung(tmp_path / "hang", 77, timeout_s=0.1)
