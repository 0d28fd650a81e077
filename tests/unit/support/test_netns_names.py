"""The pure parts of the namespace test cluster: names, addresses, the method proxy."""

from __future__ import annotations

import ipaddress
import random

import pytest

from elastic.errors import ConfigError
from tests.support.netns_names import (
    MAX_ETCD_MEMBERS,
    MAX_NODES,
    AddressPlan,
    ClusterNames,
    parse_netns_name,
)
from tests.support.netns_threads import InNamespace, in_namespace


def test_names_carry_the_owner_pid_and_parse_back() -> None:
    names = ClusterNames(4242, "0a1b2c")
    assert names.prefix == "ert4242x0a1b2c"
    assert names.netns("n3") == "ert4242x0a1b2c-n3"
    assert parse_netns_name(names.netns("n3")) == (4242, "0a1b2c", "n3")
    assert parse_netns_name(names.netns("sw")) == (4242, "0a1b2c", "sw")
    assert parse_netns_name(names.netns("obs")) == (4242, "0a1b2c", "obs")


@pytest.mark.parametrize("name", [
    "ert4242x0a1b2c", "ert4242x0a1b2c-", "ert4242x0a1b2-n0", "ertx0a1b2c-n0",
    "ert4242x0A1B2C-n0", "ert4242x0a1b2c-xx", "ert4242x0a1b2c-n0-extra", "netns-ert4242x0a1b2c-n0",
    "docker-1", "ert-unrelated-7",
])
def test_names_outside_the_scheme_are_not_ours(name: str) -> None:
    assert parse_netns_name(name) is None


def test_switch_port_names_fit_the_kernels_15_characters() -> None:
    names = ClusterNames(4_194_304, "ffffff")
    for role in ("sw", "obs", f"n{MAX_NODES - 1}", f"e{MAX_ETCD_MEMBERS - 1}", "n9999"):
        assert len(names.port(role)) <= 15
    assert names.port("n0") == "ertffffff-n0"


def test_bad_tokens_and_roles_are_refused_with_the_value() -> None:
    with pytest.raises(ConfigError, match=r"token \('xyz'\)"):
        ClusterNames(1, "xyz")
    with pytest.raises(ConfigError, match=r"role \('node0'\)"):
        ClusterNames(1, "000000").netns("node0")


def test_new_names_differ_between_clusters_of_one_owner() -> None:
    rng = random.Random(3)
    first, second = ClusterNames.new(rng), ClusterNames.new(rng)
    assert first.owner_pid == second.owner_pid and first.token != second.token


def test_addresses_lie_in_one_slash24_of_the_cluster_range_and_never_collide() -> None:
    plan = AddressPlan(4095)
    assert plan.network == ipaddress.ip_network("10.223.255.0/24")
    assert AddressPlan(0).network == ipaddress.ip_network("10.208.0.0/24")
    hosts = [plan.node(i) for i in range(MAX_NODES)]
    hosts += [plan.etcd(i) for i in range(MAX_ETCD_MEMBERS)] + [plan.observer()]
    assert len(set(hosts)) == len(hosts)
    assert all(ipaddress.ip_address(h) in plan.network for h in hosts)
    assert plan.node(0) == "10.223.255.10" and plan.etcd(1) == "10.223.255.101"
    assert plan.observer() == "10.223.255.250"


def test_random_plans_spread_over_the_range() -> None:
    rng = random.Random(7)
    assert len({AddressPlan.random(rng).network for _ in range(50)}) > 45


@pytest.mark.parametrize(("call", "message"), [
    (lambda: AddressPlan(4096), r"subnet index \(4096\)"),
    (lambda: AddressPlan(0).node(MAX_NODES), rf"node index \({MAX_NODES}\)"),
    (lambda: AddressPlan(0).etcd(-1), r"etcd member index \(-1\)"),
])
def test_out_of_range_indexes_are_refused(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()  # type: ignore[operator]


def test_the_proxy_sends_method_calls_through_call_and_reads_attributes_directly() -> None:
    calls: list[str] = []

    def call(fn: object, *args: object, **kwargs: object) -> object:
        calls.append(getattr(fn, "__name__", "?"))
        return fn(*args, **kwargs)  # type: ignore[operator]

    class Target:
        size = 3

        def add(self, a: int, *, b: int) -> int:
            return a + b + self.size

    proxied = in_namespace(call, Target())
    assert isinstance(proxied, InNamespace)
    assert proxied.add(1, b=2) == 6
    assert proxied.size == 3
    assert calls == ["add"]
