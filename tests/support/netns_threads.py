"""Threads that live inside a network namespace, to run code of the test process there.

The network namespace is a property of each *thread* in Linux: ``setns(2)`` on one thread
moves that thread only, and every socket records the namespace of the thread that created it
for its whole life. So :class:`NetnsThreads` keeps a few daemon threads that entered one
namespace at their start and runs callables on them:

* a socket created by such a callable lives in the namespace; it can afterwards be used
  (connect, send, recv, accept) from any thread;
* a thread or a child process started by such a callable is born in the namespace too (the
  kernel copies the creator thread's namespaces);
* a library that opens sockets lazily (``requests`` connection pools) must make every call on
  these threads, not only the first: see :class:`InNamespace`.

Python 3.11 has no ``os.setns``, hence the ``ctypes`` call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, Generic, TypeVar, cast

logger = logging.getLogger(__name__)

_CLONE_NEWNET: Final = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")
_Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def enter_netns(path: str) -> None:
    """Moves the calling thread into the network namespace bound at ``path``.

    Raises:
        OSError: when the namespace cannot be opened or entered.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}) failed: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsThreads:
    """A pool of daemon threads inside one network namespace.

    A thread is added whenever a call arrives and none is free (up to ``max_threads``), so a
    call that blocks (an accept loop, a long etcd start) never holds back the next one. The
    threads stay until :meth:`close`, because a child process started with
    ``PR_SET_PDEATHSIG`` dies with the *thread* that started it.

    Args:
        path: the namespace's bind mount (``/run/netns/<name>``).
        label: the name used in thread names and errors.
        max_threads: at most this many threads.
    """

    def __init__(self, path: str, label: str, max_threads: int = 32) -> None:
        self._path = path
        self._label = label
        self._max_threads = max_threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # Threads waiting for a job minus jobs queued: a new job gets a new thread unless > 0.
        self._free = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Runs ``fn(*args, **kwargs)`` on a thread inside the namespace.

        Returns:
            A future with its result or exception.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the threads of namespace {self._label} are closed.")
            if self._free <= 0 and len(self._threads) < self._max_threads:
                self._start_thread()  # one more thread waiting, and one more job for it
            else:
                self._free -= 1  # below zero: the job waits for a thread to finish its call
                if self._free < 0:
                    logger.warning("all %d threads of namespace %s are busy; a call waits",
                                   self._max_threads, self._label)
            self._jobs.put((future, fn, args, kwargs))
        return future

    def _start_thread(self) -> None:
        entered: Future[None] = Future()
        thread = threading.Thread(target=self._run, args=(entered,), daemon=True,
                                  name=f"netns-{self._label}-{len(self._threads)}")
        thread.start()
        entered.result(timeout=10)  # raises the setns error at the caller
        self._threads.append(thread)

    def _run(self, entered: Future[None]) -> None:
        try:
            enter_netns(self._path)
        except OSError as exc:
            entered.set_exception(exc)
            return
        entered.set_result(None)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the caller, who re-raises it
                    future.set_exception(exc)
            with self._lock:
                self._free += 1

    def close(self, timeout_s: float = 10.0) -> list[str]:
        """Stops every thread once its current call returns.

        Returns:
            The names of threads still running a call after ``timeout_s`` (they are daemons and
            die with the process, but they keep the namespace alive until then).
        """
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout_s / max(1, len(threads)))
        return [t.name for t in threads if t.is_alive()]


class InNamespace(Generic[T]):
    """Forwards every method call on an object to threads inside a namespace.

    Attribute reads that are not methods are served on the calling thread.

    Args:
        call: runs a callable inside the namespace and returns its result.
        target: the object whose methods must run there.
    """

    def __init__(self, call: Callable[..., Any], target: T) -> None:
        self._call = call
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute
        return functools.partial(self._call, attribute)

    def __repr__(self) -> str:
        return f"InNamespace({self._target!r})"

    @property
    def target(self) -> T:
        """The wrapped object (its methods then run on the caller's thread)."""
        return self._target


def in_namespace(call: Callable[..., Any], target: T) -> T:
    """``target`` seen through :class:`InNamespace`, typed as ``target`` for the caller."""
    return cast(T, InNamespace(call, target))
