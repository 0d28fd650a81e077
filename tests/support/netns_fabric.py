"""The switch of a test cluster: a bridge in a namespace of its own, and its fault rules.

Every host namespace is joined to the bridge ``br0`` of the switch namespace by a veth pair:
``eth0`` in the host, ``ert<token>-<role>`` on the switch. Faults are nftables rules of the
*bridge* family in the switch (table ``ert_faults``, chain ``faults`` on the forward hook):
frames are dropped between two switch ports, so the hosts' kernels see nothing happen, as when
a real switch port goes dark. Two sets drive the rules, so every fault is one set element:

* ``dark`` (switch ports): every non-ARP frame that enters or leaves such a port is dropped;
* ``cut`` (pairs of ports): every non-ARP frame from the first port to the second is dropped
  (pairs are always added in both directions).

ARP is let through on purpose: a peer that cannot resolve an address gets "No route to host"
(an ICMP-like error reported by its own kernel after about 3 s), which is not what a silent
host looks like in a cloud, where the virtual network answers ARP for instances that are gone.
Dropping in the *host's* own namespace is not silent either: its kernel refuses locally
generated packets with ``EPERM`` (a UDP ``sendto`` fails at once) and reports ``EPERM`` as
the error of a TCP connection that times out.
"""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Final

from tests.support.netns_names import run_ip

TABLE: Final = "ert_faults"
CHAIN: Final = "faults"
BRIDGE: Final = "br0"
HOST_IFNAME: Final = "eth0"
_NFT_TIMEOUT_S: Final = 30.0
_RULESET: Final = f"""
table bridge {TABLE} {{
    set dark {{ type ifname; }}
    set cut {{ type ifname . ifname; }}
    chain {CHAIN} {{
        type filter hook forward priority 0; policy accept;
        ether type arp accept
        iifname @dark counter drop
        oifname @dark counter drop
        iifname . oifname @cut counter drop
    }}
}}
"""


def nft(netns: str, *args: str, stdin: str | None = None) -> str:
    """Runs ``nft ARGS`` inside ``netns``; returns its output, raises ``RuntimeError`` on error."""
    done = subprocess.run(["ip", "netns", "exec", netns, "nft", *args], input=stdin,
                          capture_output=True, text=True, timeout=_NFT_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`nft {' '.join(args)}` in {netns} failed: {done.stderr.strip()}")
    return done.stdout


class Fabric:
    """The bridge and the fault rules of one cluster.

    Args:
        netns: the switch namespace's name (created by :meth:`create`).
        prefix_len: the prefix length of the hosts' addresses.
    """

    def __init__(self, netns: str, prefix_len: int) -> None:
        self.netns = netns
        self._prefix_len = prefix_len
        self._dark: set[str] = set()
        self._cut: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # faults may come from a timer thread as well

    def create(self) -> None:
        """Creates the switch namespace, its bridge and the empty fault rules."""
        run_ip("netns", "add", self.netns)
        run_ip("-n", self.netns, "link", "set", "lo", "up")
        run_ip("-n", self.netns, "link", "add", BRIDGE, "type", "bridge")
        run_ip("-n", self.netns, "link", "set", BRIDGE, "up")
        nft(self.netns, "-f", "-", stdin=_RULESET)

    def attach(self, host_netns: str, port: str, address: str) -> None:
        """Links ``host_netns`` to the bridge through switch port ``port``.

        Both ends of the veth pair are created directly in their namespaces (nothing appears
        in the root namespace, even for a moment); the host gets ``address`` on ``eth0`` and
        its loopback is brought up.
        """
        run_ip("-n", self.netns, "link", "add", port, "type", "veth",
               "peer", "name", HOST_IFNAME, "netns", host_netns)
        run_ip("-n", self.netns, "link", "set", port, "master", BRIDGE, "up")
        run_ip("-n", host_netns, "addr", "add", f"{address}/{self._prefix_len}",
               "dev", HOST_IFNAME)
        run_ip("-n", host_netns, "link", "set", HOST_IFNAME, "up")
        run_ip("-n", host_netns, "link", "set", "lo", "up")

    def set_dark(self, port: str, dark: bool) -> None:
        """Drops (or stops dropping) every non-ARP frame into and out of ``port``."""
        with self._lock:
            if dark == (port in self._dark):
                return
            nft(self.netns, "add" if dark else "delete", "element", "bridge", TABLE, "dark",
                f'{{ "{port}" }}')
            (self._dark.add if dark else self._dark.discard)(port)

    def set_cut(self, port_a: str, port_b: str, cut: bool) -> None:
        """Drops (or stops dropping) every non-ARP frame between ``port_a`` and ``port_b``."""
        pairs = {(port_a, port_b), (port_b, port_a)}
        with self._lock:
            change = pairs - self._cut if cut else pairs & self._cut
            if not change:
                return
            elements = ", ".join(f'"{a}" . "{b}"' for a, b in sorted(change))
            nft(self.netns, "add" if cut else "delete", "element", "bridge", TABLE, "cut",
                f"{{ {elements} }}")
            if cut:
                self._cut |= change
            else:
                self._cut -= change

    def is_dark(self, port: str) -> bool:
        """True while ``port`` is dark."""
        with self._lock:
            return port in self._dark

    def cut_pairs(self) -> frozenset[tuple[str, str]]:
        """The (from, to) port pairs cut now."""
        with self._lock:
            return frozenset(self._cut)

    def clear(self) -> None:
        """Removes every fault."""
        with self._lock:
            for set_name in ("dark", "cut"):
                nft(self.netns, "flush", "set", "bridge", TABLE, set_name)
            self._dark.clear()
            self._cut.clear()

    def dropped_packets(self) -> int:
        """How many frames the fault rules have dropped since the cluster started."""
        listing = json.loads(nft(self.netns, "-j", "list", "chain", "bridge", TABLE, CHAIN))
        total = 0
        for item in listing.get("nftables", []):
            for expr in item.get("rule", {}).get("expr", []):
                if isinstance(expr, dict) and "counter" in expr:
                    total += int(expr["counter"]["packets"])
        return total
