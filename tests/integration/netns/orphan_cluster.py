"""Leaves a cluster behind, for the sweep test: start one, then wait to be SIGKILLed.

Prints one line, ``<namespace prefix> <pid>``, once the cluster is up: the pid is a process
inside node 0 that left its process tree (its parent exited), so only a sweep by namespace can
find it.
"""

from __future__ import annotations

import subprocess
import time

from tests.support.netns import NetnsCluster


def main() -> None:
    cluster = NetnsCluster(nodes=1, etcd_members=0).start()
    shell = cluster.nodes[0].popen(["sh", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"],
                                   stdout=subprocess.PIPE, text=True)
    sleeper = int(shell.communicate(timeout=10)[0])
    print(cluster.names.prefix, sleeper, flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
