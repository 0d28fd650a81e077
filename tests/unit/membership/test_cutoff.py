"""Telling a cut-off node from a job-wide etcd outage, and how a run ended while a node was
away (:mod:`membership.cutoff`); the whole path runs for real in
``tests/integration/netns/test_netns_faults.py`` (a cut longer than the etcd deadline)."""

from __future__ import annotations

import socket

import pytest

from elastic.contract.records import GenerationRecord
from membership.cutoff import (
    TRAINED_ON_TTLS,
    cut_off,
    ended_while_away,
    peers_answer,
    workers_trained_on,
)

TTL = 3.0


def test_workers_that_trained_long_after_the_last_refresh_mean_etcd_is_gone_for_all() -> None:
    # A job-wide outage: the collectives need no etcd, so the steps went on.
    assert workers_trained_on(progress_at=129.0, refreshed_at=100.0, ttl=TTL)


def test_workers_that_stopped_when_the_others_dropped_the_node_mean_it_was_cut_off() -> None:
    # The last step completed before the others could have moved on without this node
    # (a TTL after the last refresh), or while they did.
    assert not workers_trained_on(progress_at=99.0, refreshed_at=100.0, ttl=TTL)
    assert not workers_trained_on(progress_at=100.0 + TTL + 1.0, refreshed_at=100.0, ttl=TTL)
    assert not workers_trained_on(progress_at=100.0 + TRAINED_ON_TTLS * TTL,
                                  refreshed_at=100.0, ttl=TTL)


@pytest.mark.parametrize(("progress_at", "refreshed_at"), [(None, 100.0), (150.0, None)])
def test_no_evidence_keeps_the_outage_behaviour(progress_at: float | None,
                                                refreshed_at: float | None) -> None:
    # A script without ElasticLoop never reports a step: the node stops as on an outage.
    assert workers_trained_on(progress_at, refreshed_at, ttl=TTL)


def test_steps_decide_when_the_workers_reported_some() -> None:
    assert cut_off(99.0, 100.0, TTL, peers_answering=True)
    assert not cut_off(129.0, 100.0, TTL, peers_answering=False)


def test_without_steps_a_node_no_peer_answers_is_cut_off() -> None:
    # A node that had just joined (or runs a plain script): its peers tell. None answering
    # means its own link is down; one answering, or no peer at all, cannot tell.
    assert cut_off(None, 100.0, TTL, peers_answering=False)
    assert not cut_off(None, 100.0, TTL, peers_answering=True)
    assert not cut_off(None, 100.0, TTL, peers_answering=None)


def test_peers_answer_probes_for_real() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        live = listening.getsockname()
        dead = closed.getsockname()
        assert peers_answer([dead, live]) is True
        assert peers_answer([dead]) is False
    assert peers_answer([]) is None


def test_a_run_still_running_did_not_end() -> None:
    assert ended_while_away(GenerationRecord(4, "running"), 4) is None


def test_a_run_that_finished_while_the_node_was_away_ends_it_with_exit_0() -> None:
    code, outcome, message = ended_while_away(GenerationRecord(4, "finished"), 4) or (-1, "", "")
    assert (code, outcome) == (0, "already_finished")
    assert message == "run 4 finished while this node was cut off from etcd."


def test_a_run_that_failed_or_was_replaced_ends_it_with_exit_1() -> None:
    failed = ended_while_away(GenerationRecord(4, "failed"), 4)
    assert failed is not None and failed[:2] == (1, "failed")
    replaced = ended_while_away(GenerationRecord(6, "running"), 4)
    assert replaced is not None and replaced[0] == 1
    assert "running run 6 now" in replaced[2]
    gone = ended_while_away(None, 4)
    assert gone is not None and gone[0] == 1 and "unknown" in gone[2]
