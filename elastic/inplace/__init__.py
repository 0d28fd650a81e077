"""In-place reconfiguration: surviving workers keep training through a membership change.

Under ``elastic-run`` (default mode ``auto``), a script whose steps are guarded, through the
managed ``ElasticLoop`` (``loop.batches()``/``loop.backward()``) or ``loop.step_guard()``,
runs in place: a worker process lives as long as it can train; nobody restarts it because
another worker or node came or went. Design:

* **Membership is the agents'** (:mod:`membership`): every node agent holds its node's
  record on its own etcd lease, and an elected leader writes each new world (epoch,
  members in rank order, the store its groups meet on) by compare-and-swap. Workers never
  talk to etcd: their agent passes every world to them over a local socket
  (:mod:`elastic.agent_link`), so etcd's load grows with nodes, not workers, and etcd's
  credentials never reach a worker.
* **Abort on evidence** (:mod:`~elastic.inplace.controller`, :mod:`~elastic.inplace.abort`):
  when a newer world drops a member of this worker's world (not marked as departing), or the
  agent reports a local peer dead, the worker's link thread aborts its world at once: gloo's
  connections are severed (gloo cannot abort a group that is still referenced), NCCL's
  communicators aborted. A collective blocked on a silent peer fails now, not at its
  timeout; a build waiting for a member that will not come fails too. A silent host costs the
  survivors its lease TTL (``--inplace-ttl``, 3 s); a crashed worker or a dead node (its
  agent's liveness port refuses) costs a fraction of a second.
* **Failures are told apart by type and evidence**, never by message text: only collective
  error types can be a peer's failure, and only when membership confirms a member is gone;
  anything else ends the worker with its own error. A step abandoned more than
  ``ELASTIC_MAX_STEP_RETRIES`` (3) times stops the worker with one sentence.
* **Planned changes happen at a step boundary**: every rank agrees one step after any rank
  saw a newer world (joiners, a departing node), with one asynchronous all-reduce per step.
  Before a planned change every rank waits for the save in flight, which runs on the old
  groups. A departing node's workers leave at that boundary; nobody restarts.
* **Building a world**: groups are built over ``PrefixStore(f"e{epoch}/", TCPStore)`` on a
  store server hosted by a member's agent (a fresh server per world: no world reads an older
  world's keys, and a worker crash never takes the store down). A world that cannot be built
  (a member died meanwhile) is followed by the next; an epoch is never built twice.
* **Joining**: a worker that starts while a world trains (a replacement, a new node) starts
  as a *joiner*: ``elastic.init()`` returns at once on local standby groups; it turns ready
  when its training loop starts, so survivors keep training while it builds its model.
* **Heal** (:mod:`~elastic.inplace.heal`): all ranks all-gather their completed step; the
  lowest rank holding the highest step streams its state (model, optimizer, loop state, RNG,
  data cursor), tensor by tensor and point to point, to the ranks behind it only, straight
  onto each receiver's own device. Lost work is at most the step in flight. Storage is read
  only when no rank holds state (a fresh job, or every worker died).
* **Hung workers** (the progress rule): a worker that waits in a step's collective for longer
  than ``max(--hang-timeout, --hang-factor x median step time)`` says so; the leader evicts
  the workers every other worker waits for, and their agent replaces them. A stopped
  (SIGSTOPped) worker falls silent and is replaced after the TTL.
* **Fencing**: a checkpoint is committed only while the node's lease is fresh and the
  worker's world is not aborted, so a node cut off from the job never commits one.

Replicated state (DDP) heals as above; a sharded model (``ElasticLoop(parallelize=...)``,
FSDP2 and HSDP) is re-sharded from the survivors' shards and their peer copies instead
(:mod:`elastic.sharded`, ``docs/sharded.md``). gloo on CPU is tested. The NCCL path (abort from a
thread, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, and the step fence of
:mod:`~elastic.inplace.step_fence`: by default a host wait for the stream and a check before
each optimizer step, ``ELASTIC_NCCL_STEP_FENCE=0`` to check later instead) has GPU tests in
``tests/gpu`` that skip where CUDA is absent.
"""
