"""The address a node registers for its peers, and the network interface that holds it."""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
import urllib.parse

from elastic_errors import ConfigError

__all__ = ["interface_of", "registered_address"]


def registered_address(local_addr: str | None, endpoint: str) -> str:
    """The address peers dial to reach this node.

    ``--local-addr`` when given; otherwise the address of the interface this host uses to
    reach etcd (a UDP ``connect`` sends nothing, it only picks the route), which is the
    address the other nodes can reach too. ``gethostname()`` is never used: from another
    pod or host that name usually does not resolve.

    Raises:
        ConfigError: If neither gives an address.
    """
    if local_addr:
        return local_addr
    first = endpoint.split(",")[0].strip()
    parsed = urllib.parse.urlsplit(first if "://" in first else f"http://{first}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 2379
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"could not find the address that reaches etcd ({first}: {exc}); pass "
            "--local-addr with this node's address."
        ) from exc


_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: a 16-byte name and a 24-byte union
_MAX_IPV4_ADDRESSES = 1024


def _ipv4_interfaces() -> dict[str, str]:
    """Every IPv4 address of this host's network namespace -> its interface name (Linux).

    ``SIOCGIFCONF`` lists every configured address, secondary ones too (under their label,
    e.g. ``eth0:1``, which is what gloo's and NCCL's interface lookups match).
    """
    buffer = array.array("B", bytes(_IFREQ_SIZE * _MAX_IPV4_ADDRESSES))
    address, _ = buffer.buffer_info()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", len(buffer), address)
        used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
    raw = buffer.tobytes()[:used]
    found = {}
    for offset in range(0, used, _IFREQ_SIZE):
        name = raw[offset:offset + 16].split(b"\0", 1)[0].decode(errors="replace")
        found[socket.inet_ntoa(raw[offset + 20:offset + 24])] = name
    return found


def _ipv6_interfaces() -> dict[str, str]:
    """Every IPv6 address of this host's network namespace -> its interface name (Linux)."""
    found = {}
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except (OSError, ValueError):
        return {}
    return found


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (``None``: none
    does, e.g. an address behind NAT, or a system without the Linux interfaces).

    Libraries that pick their own interface (gloo from the hostname, NCCL by its own rules)
    are told this one, so that every connection a peer dials goes to the registered address.
    """
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return None
    try:
        table = _ipv6_interfaces() if parsed.version == 6 else _ipv4_interfaces()
    except OSError:
        return None
    return table.get(str(parsed))
