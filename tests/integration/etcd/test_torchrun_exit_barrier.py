"""torchrun's exit barrier on the etcd-v3 store outlasts the end of the run.

torch's agent, once its workers succeeded, waits in an exit barrier on the rendezvous store
(``torch.distributed.elastic.utils.store.barrier``: every agent adds one to a counter, the
last one sets a key, everyone waits for that key), then shuts the rendezvous down, which
ends the run. The last agent to check in is the first one through, so it can end the run
while a slower agent has checked in but not yet read the key. When the end deleted the
store at once, that agent waited out torch's 300 s barrier timeout (CI saw it as a torchrun
job hanging after both nodes finished). The store now goes with the end record's lease.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.utils import store as store_util

from elastic.contract.records import EndRecord
from membership.generation import end_run, open_run
from membership.keys import JobKeys
from membership.store import EtcdV3Store
from tests.integration.etcd.test_rdzv_protocol import client_for

pytestmark = pytest.mark.etcd

BARRIER = "torchelastic/agent/terminal_state"


class HeldStore(EtcdV3Store):
    """The slow agent's store: its first ``wait`` (the barrier's) is held until released,
    so the agent has checked in but not yet read the barrier's last key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checked_in = threading.Event()
        self.release = threading.Event()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.checked_in.set()
        assert self.release.wait(30), "the test never released the slow agent"
        super().wait(keys, timeout)


def test_an_agent_still_in_the_exit_barrier_passes_it_after_a_faster_one_ended_the_run(
    etcd_server: Any, etcd_prefix: str
) -> None:
    client = client_for(etcd_server)
    keys = open_run(client, JobKeys(etcd_prefix, "job")).keys
    round_store = f"{keys.store}e1/"  # what the handler hands torch's agent for a world
    slow = HeldStore(client_for(etcd_server), round_store)
    fast = EtcdV3Store(client_for(etcd_server), round_store)
    errors: list[BaseException] = []

    def slow_agent() -> None:
        try:
            store_util.barrier(slow, world_size=2, key_prefix=BARRIER, barrier_timeout=10)
        except BaseException as exc:  # the test's verdict, read below
            errors.append(exc)

    thread = threading.Thread(target=slow_agent, daemon=True)
    thread.start()
    assert slow.checked_in.wait(30)
    store_util.barrier(fast, world_size=2, key_prefix=BARRIER, barrier_timeout=10)
    # The fast agent's handler shuts the rendezvous down: the run ends.
    assert end_run(client, keys, EndRecord("finished", "torchrun's agent shut down"))
    slow.release.set()
    thread.join(30)
    assert not thread.is_alive() and errors == []
    # Nothing of the run stays for good: the store is on the end record's lease.
    end = client.get(keys.end)
    assert end is not None
    assert {kv.lease for kv in client.get_prefix(keys.store)} == {end.lease}
