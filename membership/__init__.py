"""elastic-run's control plane: etcd, the membership protocol, and telling dead peers from slow.

Only node agents (``launch``) and torchrun's plugin (:mod:`membership.rendezvous`) import this
package; workers never do (they learn the world from their agent over the local channel, and
``tests/unit/test_import_rules.py`` fails if a worker-side module imports it). What they share
with it is :mod:`elastic.contract`. What is here:

* the etcd v3 client and its watch (:mod:`~membership.etcd`), and an etcd ``Store`` for the
  plugin (:mod:`~membership.store`);
* the rendezvous protocol: keys, runs, node records, the job view, the leader's pure decisions
  (:mod:`~membership.decide`) and its loop (:mod:`~membership.leader`), and
  :class:`~membership.job.RunMembership`, the one object an agent holds;
* telling a dead or silent peer from a slow one: liveness ports (:mod:`~membership.liveness`),
  the silent-peer rule (:mod:`~membership.silent_peers`), and the cut-off rule for a node that
  lost etcd (:mod:`~membership.cutoff`).

The membership protocol on etcd: JSON node records, one world, one authority.

Keys of one job id (``key_prefix`` defaults to ``/elastic``)::

    {prefix}/{job}/generation            the current run of the job id (running / finished /
                                         failed); an ended run's id is reused for a fresh run
                                         at once; once ended, on a one-day lease
    {prefix}/{job}/g{n}/nodes/{node}     one JSON record per node, written only by its agent
                                         (plain puts), on the agent's lease (TTL
                                         ``--inplace-ttl``): the node's address, its spare
                                         store port, its workers and their readiness
    {prefix}/{job}/g{n}/job/world        the world: JSON {epoch, members with their workers in
                                         rank order, store, mode}, written only by
                                         compare-and-swap on its mod revision
    {prefix}/{job}/g{n}/job/leader       the leader's node id, on the leader's lease
    {prefix}/{job}/g{n}/job/end          how the run ended (on a lease: ``linger`` or 30 s)
    {prefix}/{job}/g{n}/store/           an etcd Store for torchrun's agent (plugin only)

One authority: the world's epochs are the only sequence. Agent rounds (restart mode) and
in-place reconfigurations are the same epochs of the same record, and the leader is the only
writer of it; every other agent follows ``job/`` with one watch. Costs: a join is one put
(never a conflict), a heartbeat is a lease keep-alive (no write), a round is one
compare-and-swap by the leader, and a vacancy costs one create attempt per agent. Workers do
not talk to etcd at all: they learn the world from their node's agent over a local socket, so
etcd's load grows with nodes, never with workers, and credentials stay with the agent.

Nothing is pickled: every value is JSON with a ``format`` field, parsed field by field
(:mod:`~elastic.contract.records`); a foreign or damaged value is refused with one sentence.
"""
