"""``ElasticLoop`` and its parts, one concern per module.

* :mod:`~elastic.loop.core`: the loop itself: which step runs next, the two ways to write a
  step (managed and explicit), restore, the in-place hooks, the per-step agreement;
* :mod:`~elastic.loop.saves`: when it saves, and how long training waits for a commit;
* :mod:`~elastic.loop.signals`: SIGTERM as a drain request, DataLoader workers shielded;
* :mod:`~elastic.loop.replicas`: DDP on the current world, and the managed model;
* :mod:`~elastic.loop.loop_state`: the loop's own checkpointed state.
"""

from __future__ import annotations

from elastic.loop.core import ElasticLoop

__all__ = ["ElasticLoop"]
