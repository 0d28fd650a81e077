"""elastic-run: fault-tolerant elastic training for PyTorch.

This module must stay import-light: torch imports ``elastic.rendezvous`` through the
``torchrun.handlers`` entry point while ``torch.distributed.elastic`` is itself being imported,
so public names are resolved lazily (PEP 562) instead of being imported here.
"""

from __future__ import annotations
