"""elastic-run for training scripts built on a framework's trainer (restart mode).

* :mod:`elastic.integrations.lightning`: Lightning's ``Trainer`` (extra ``lightning``);
* :mod:`elastic.integrations.hf`: Hugging Face's ``Trainer`` (extra ``hf``).

Each gives a script, in at most five lines, what ``ElasticLoop`` gives its own scripts where
the framework lets it: it resumes from the newest *committed* checkpoint (a commit marker,
written last, makes a framework checkpoint's completeness verifiable), turns a preemption
notice or any drain the agent asks for into "save now and stop" at the next step boundary,
reports steps and checkpoints to the node agent (``elastic-run goodput``, ``--metrics-port``)
and keeps the global batch fixed and the data order exactly once across world changes. The
jobs restart on a membership change; ``docs/frameworks.md`` says why they cannot reconfigure
in place, and what each framework leaves out.

The framework modules import their framework; this package and its shared parts import
neither, so the core never needs them.
"""

from __future__ import annotations

__all__: list[str] = []
