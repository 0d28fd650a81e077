"""In-place reconfiguration: surviving workers keep training through a membership change.

With ``elastic-run`` in its default mode (``auto``) for a script that calls
``elastic.init(inplace=True)``, or with ``--elastic-mode inplace`` for any script, a worker
process lives as long as it can train; nobody restarts it because another worker or
node came or went. Design (torchft-like, fenced by etcd compare-and-swap):

* **Quorum** (:mod:`~elastic.inplace.quorum`): every worker holds a member key on its own
  short lease; a ``world`` key holds ``{epoch, members}`` and is only written by CAS, so a
  world is agreed by etcd's Raft quorum and never by one worker. A prefix watch keeps both
  in memory.
* **When**: at every step boundary the drain all-reduce of :class:`~elastic.loop.ElasticLoop`
  carries one more flag, "the live members differ from the world", so all ranks reconfigure
  at the same step (joins, spares admitted). When a collective raises because a peer died
  (gloo: at once, connection reset), ``loop.step_guard()`` abandons the step (drops its
  gradients and loader iterator) and the worker reconfigures before the next step.
* **How** (:mod:`~elastic.inplace.controller`, :mod:`~elastic.inplace.groups`): wait until the
  dead worker's key is gone (its agent deletes it at once after a worker crash; a survivor
  deletes it at once when the worker's liveness port refuses, :mod:`~elastic.inplace.liveness`,
  as when a node's whole process tree dies; a host gone silent loses its keys after the TTL),
  propose epoch+1 with the live members in join order, truncated
  to the largest count that divides the global batch (the rest wait as spares; the loser of
  the CAS adopts the winner's world), destroy (NCCL: abort) the old groups and build new ones
  over ``PrefixStore(f"e{epoch}/", EtcdV3Store)``. If a member does not arrive within the
  build timeout (it died meanwhile) the next epoch is proposed: an epoch is never built twice
  (its prefix holds the failed attempt's keys), and torch's group-name counter is reset
  before every build so that all members name their groups alike. Before a planned change
  (joiners, no failure) every rank first waits for the save in flight, which runs on the old
  groups.
* **Severing**: gloo cannot abort a group that is still referenced (a DDP in the script's
  frame), so a survivor that abandons a world after a failure shuts down that world's TCP
  connections itself (:mod:`~elastic.inplace.sockets`): a peer blocked in a collective with it
  fails at once instead of after the collective timeout.
* **Joining**: a worker that starts while a world trains registers *not ready* and
  ``elastic.init()`` returns at once (on local standby groups, with the running world's size
  and last rank as provisional values, so "rank 0 only" set-up code does not run on it unless
  one worker trains alone); it turns ready when its loop starts, so survivors keep training
  while it builds its model and are held only for the group build and the heal.
* **Heal** (:mod:`~elastic.inplace.heal`): all ranks all-gather their completed step; the
  lowest rank holding the highest step broadcasts model, optimizer, loop state, RNG and
  sampler cursor to the ranks behind it (newcomers, or a survivor that did not finish the
  step a peer died in). Lost work is at most the step in flight. Storage is read only when
  no rank holds state (a fresh job, or every worker died).
* **Data**: the batch is re-planned for the new world (same global batch) and the sampler is
  re-sharded from the agreed step's cursor, so the exactly-once property of the restart path
  holds: samples of an abandoned step were never applied and are trained again.

What in-place mode needs from the training script: ``elastic.init()``, an ``ElasticLoop``,
each step's body inside ``with loop.step_guard():``, the model wrapped per step with
``loop.data_parallel(model)`` (DDP is rebuilt on each new world), a ``DataLoader`` built with
``loop.micro_batch_size`` (rebuild it when that changes), and no collectives outside the loop
(a joiner's collectives must match the survivors'). Data parallelism only (DDP-style
replicated state); gloo on CPU is tested, NCCL is written (abort on tear-down) but not
exercised here.
"""
