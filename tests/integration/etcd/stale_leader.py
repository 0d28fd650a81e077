"""A real agent process for the deposed-leader tests (``test_deposed_leader.py``).

It joins a run as one node with a real :class:`~membership.job.RunMembership` and leads if
it wins the election. Once ``--pause-file`` exists, the next world write it is about to send
stops the whole process (SIGSTOP to itself, so its lease keep-alive stops too) right before
the request leaves: the worst moment for a leader to be frozen. It first writes what it was
about to write to ``--out``/``proposal``; after it is resumed (SIGCONT from the test) and the
write was answered, it writes the answer to ``--out``/``outcome`` and exits.

Usage: ``python stale_leader.py ENDPOINT PREFIX JOB GENERATION OUT PAUSE_FILE READY_WORKERS``
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic.contract.records import NodeRecord, WorkerSlot
from membership.decide import RunLimits
from membership.etcd import EtcdClient, EtcdConfig
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys

#: The lease TTL of every node in these tests (etcd's minimum is about 2 s).
TTL = 2
LIMITS = RunLimits(min_nodes=1, max_nodes=3, last_call=0.5)


def main(argv: list[str]) -> int:
    endpoint, prefix, job, generation, out_dir, pause_file, ready = argv
    out, pause = Path(out_dir), Path(pause_file)
    client = EtcdClient(EtcdConfig(endpoints=(endpoint,), request_timeout=timedelta(seconds=2),
                                   deadline=timedelta(seconds=10)))
    keys = JobKeys(prefix, job, int(generation))
    answered = threading.Event()

    def frozen_before(call: Callable[..., Any], written: Callable[[Any], bool]) -> Any:
        """``call`` (a client method), stopping the process before a world write goes out."""

        def world_write(key: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
            stopping = key == keys.world and pause.exists()
            if stopping:
                pause.unlink()
                (out / "proposal").write_bytes(value)
                logging.info("freezing before the world write (%s %s)", args, kwargs)
                # Sent to this thread, the stop takes effect before the call returns: sent to
                # the process, another thread may take it while this one sends its write.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
                logging.info("resumed")
            result = call(key, value, *args, **kwargs)
            if stopping:
                (out / "outcome").write_text(json.dumps({"written": written(result)}))
                logging.info("the world write was answered: %s", result)
                answered.set()
            return result

        return world_write

    # Every way a world can be written: compare-and-swap, and (were it ever used) a put.
    client.cas = frozen_before(client.cas, lambda r: bool(r[0]))  # type: ignore[method-assign]
    client.put = frozen_before(client.put, lambda r: True)  # type: ignore[method-assign]
    run = RunMembership(client, keys, limits=LIMITS, ttl=TTL, linger=2)
    record = NodeRecord(
        node=new_node_id("stale"), host="stale", addr="127.0.0.1", agent_pid=os.getpid(),
        store_port=4999, workers=(WorkerSlot(0, 1, ready == "1", True, 0),))
    run.join(record)
    (out / "node").write_text(record.node)
    done = answered.wait(120)
    # Its lease is gone (the stop outlasted it): leave as an agent that lost its lease would.
    run.leave()
    return 0 if done else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
