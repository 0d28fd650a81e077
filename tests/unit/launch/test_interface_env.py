"""Workers' gloo and NCCL are told the interface of the node's registered address."""

from __future__ import annotations

import socket

from launch.runner import interface_env
from membership.address import interface_of, registered_address


def _outbound_address() -> str:
    # The address of the interface with a default route (nothing is sent).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.250", 9))
        return str(probe.getsockname()[0])


def test_the_interface_holding_an_address_is_found() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") == "lo"
    outbound = _outbound_address()
    ifname = interface_of(outbound)
    assert ifname is not None and ifname != "lo"
    # The address registered for an etcd on loopback is loopback's.
    assert interface_of(registered_address(None, "127.0.0.1:2379")) == "lo"


def test_an_address_no_interface_holds_gives_none() -> None:
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: not on this host
    assert interface_of("etcd-0.example") is None
    assert interface_of("") is None


def test_the_workers_get_the_interface_unless_the_user_chose_one() -> None:
    assert interface_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo",
                                              "NCCL_SOCKET_IFNAME": "lo"}
    assert interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"}) == {
        "NCCL_SOCKET_IFNAME": "lo"}
    assert interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "a",
                                       "NCCL_SOCKET_IFNAME": "b"}) == {}
    assert interface_env("203.0.113.77", {}) == {}
