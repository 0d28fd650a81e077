"""What every agent follows: the world record, the leader and the run's end.

One prefix watch on the run's small control keys (``g{n}/job/``); agents do not watch each
other's node records (only the leader does), so a round of N nodes costs O(N) watch events,
not O(N^2).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from elastic.contract.records import EndRecord, RecordError, WorldRecord
from membership.etcd import EtcdClient, KeyValue, PrefixWatch, WatchEvent
from membership.keys import JobKeys

__all__ = ["JobView"]

logger = logging.getLogger(__name__)


class JobView:
    """A live, parsed mirror of the run's control keys.

    Args:
        client: The etcd client.
        keys: The run's keys.
        on_change: Called from the watch thread after every change (must not block).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys,
                 on_change: Callable[[], None] | None = None) -> None:
        self._keys = keys
        self._listeners: list[Callable[[], None]] = []
        if on_change is not None:
            self._listeners.append(on_change)
        # Notified after each parse: waiting on the watch's own condition could wake before
        # the parsed view caught up with the mirror and then sleep through the change.
        self._lock = threading.Condition()
        self._world: WorldRecord | None = None
        self._world_error: RecordError | None = None
        # The run's end, kept once seen: the end key may go (its short lease, a fresh run of
        # the job id clearing the old one's keys) before every member has looked.
        self._end: EndRecord | None = None
        self._reported: set[tuple[str, int]] = set()
        self._watch = client.watch_prefix(keys.control, on_change=self._on_events)
        self._parse(self._watch.items())

    @property
    def watch(self) -> PrefixWatch:
        """The underlying watch (its ``failed`` event says etcd was lost for good)."""
        return self._watch

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Also calls ``listener`` after every change."""
        self._listeners.append(listener)

    def _on_events(self, events: Sequence[WatchEvent]) -> None:
        watch = getattr(self, "_watch", None)
        if watch is None:  # the watch's first snapshot, during __init__: parsed right after
            return
        for event in events:  # an end put and deleted within one batch is still the end
            if event.key == self._keys.end and event.kv is not None:
                self._latch_end(event.kv)
        self._parse(watch.items())
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # a listener must never take the watch down
                logger.exception("job view listener failed")

    def _latch_end(self, kv: KeyValue) -> None:
        if self._end is not None:
            return
        try:
            self._end = EndRecord.loads(kv.value, kv.key)
        except RecordError as exc:
            self._report(kv, exc)

    def _parse(self, items: Mapping[str, KeyValue]) -> None:
        if (end := items.get(self._keys.end)) is not None:
            self._latch_end(end)
        kv = items.get(self._keys.world)
        world, error = None, None
        if kv is not None:
            try:
                world = WorldRecord.loads(kv.value, kv.key, revision=kv.mod_revision)
            except RecordError as exc:
                error = exc
                self._report(kv, exc)
        with self._lock:
            self._world, self._world_error = world, error
            self._lock.notify_all()

    def _report(self, kv: KeyValue, exc: RecordError) -> None:
        if (kv.key, kv.mod_revision) not in self._reported:
            self._reported.add((kv.key, kv.mod_revision))
            logger.error("%s", exc)

    def world(self) -> WorldRecord | None:
        """The current world, or ``None`` if there is none (or it is not a valid record)."""
        with self._lock:
            return self._world

    def world_error(self) -> RecordError | None:
        """Why the world key was refused, if it holds something that is not a world record."""
        with self._lock:
            return self._world_error

    def world_kv(self) -> KeyValue | None:
        """The raw world key (its revision is the CAS token even when it is not valid)."""
        return self._watch.items().get(self._keys.world)

    def leader(self) -> str | None:
        """The leader's node id, or ``None`` while nobody leads (see :meth:`leader_kv`)."""
        kv = self._watch.items().get(self._keys.leader)
        if kv is None or kv.lease == 0:
            return None
        try:
            return kv.value.decode() or None
        except UnicodeDecodeError:
            return None

    def leader_kv(self) -> KeyValue | None:
        """The raw leader key. Only a value that :meth:`leader` names is a leader: a key on
        no lease, or not a node id, was not written by a campaign (a leader's key is on its
        node's lease) and may be replaced by the next candidate."""
        return self._watch.items().get(self._keys.leader)

    def end(self) -> EndRecord | None:
        """How the run ended (kept once seen), or ``None`` while it runs."""
        with self._lock:
            return self._end

    @property
    def revision(self) -> int:
        """The etcd revision the view reflects."""
        return self._watch.revision

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> bool:
        """Waits until ``predicate(self)`` holds, woken by the watch; returns whether it did."""
        with self._lock:
            return self._lock.wait_for(
                lambda: predicate(self) or self._watch.failed.is_set(), max(0.0, timeout)
            ) and predicate(self)

    def close(self) -> None:
        """Stops the watch."""
        self._watch.cancel()
