"""``ElasticLoop`` and its parts, one concern per module.

* :mod:`~elastic.loop.core`: the loop itself: which step runs next, restore, closing a step;
* :mod:`~elastic.loop.microbatch`: the batch plan of the current world and its micro-batches;
* :mod:`~elastic.loop.managed`: the managed way (the loop owns model wrapper, optimizer step
  and data);
* :mod:`~elastic.loop.inplace_hooks`: the loop's side of in-place reconfiguration, and
  abandoning a step a peer's failure broke;
* :mod:`~elastic.loop.agreement`: every rank agreeing on a drain or a newer world;
* :mod:`~elastic.loop.reporting`: events, the per-sample audit, messages to the node agent;
* :mod:`~elastic.loop.saves`: when it saves, and how long training waits for a commit;
* :mod:`~elastic.loop.signals`: SIGTERM as a drain request, DataLoader workers shielded;
* :mod:`~elastic.loop.replicas`: DDP on the current world, and the managed model;
* :mod:`~elastic.loop.loop_state`: the loop's own checkpointed state.
"""

from __future__ import annotations

from elastic.loop.core import ElasticLoop

__all__ = ["ElasticLoop"]
