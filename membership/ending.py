"""When the node records show that the run is over: pure functions, part of the leader's
decisions (:mod:`membership.decide`).

A script that tells its agent it finished (``ElasticLoop``: the world's rank 0, once its final
checkpoint is committed) ends the run itself; these rules end it when nobody does:

* every node reports the same failure at the same step: the script's own bug
  (:func:`~membership.proposal.common_failure`), at once;
* every member of the current world is done (plain torch scripts), at once;
* every live node is done (after a loss left an empty world, whoever is still here is done),
  once that held for a grace: a node missing meanwhile, joining again after etcd dropped its
  lease, may be the one that has not finished (a rank 0 whose final checkpoint the same etcd
  stall fenced off refuses to end the run; the steps after the last checkpoint are trained
  again, see :mod:`membership.decide`).
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic.contract.records import EndRecord, NodeRecord, WorldRecord
from membership.proposal import common_failure

__all__ = ["run_end", "run_over"]


def run_over(current: WorldRecord | None, nodes: Sequence[NodeRecord]) -> EndRecord | None:
    """The run's end when the node records show it at once: the script's own bug, or every
    member of the current world done training."""
    failure = common_failure(nodes)
    if failure is not None:
        when = f"at step {failure.step}" if failure.step >= 0 else "before its first step"
        return EndRecord("failed", f"the training script failed on every worker {when}: "
                         f"{failure.error}", failure.step)
    if current is None or not current.members:
        return None
    by_node = {n.node: n for n in nodes}
    if all((n := by_node.get(m.node)) is not None and n.done for m in current.members):
        return EndRecord("finished", "every worker finished training")
    return None


def run_end(current: WorldRecord | None, nodes: Sequence[NodeRecord], *,
            done_since: float | None, grace: float, now: float
            ) -> tuple[EndRecord | None, float | None]:
    """:func:`run_over`, or every live node done for ``grace`` seconds.

    Args:
        current: The current world (``None`` before the first).
        nodes: The live node records.
        done_since: What the previous call returned: since when every live node is done.
        grace: How long that must hold (the node lease TTL: a node that lost its lease is
            back within it).
        now: The clock.

    Returns:
        The end (or ``None``), and ``done_since`` for the next call.
    """
    ended = run_over(current, nodes)
    if ended is not None:
        return ended, done_since
    if not nodes or not all(n.done for n in nodes):
        return None, None
    since = now if done_since is None else done_since
    if now - since >= grace:
        return EndRecord("finished", "every worker finished training"), since
    return None, since
