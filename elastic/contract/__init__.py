"""The contract between the control plane and the workers: the one thing both sides import.

Two programs share a node: the node agent (``launch``, over the control plane in
``membership``) and the workers (``elastic``, ``checkpointing``). They agree on exactly this:

* :mod:`~elastic.contract.records`: the JSON records of etcd (node, world, end, generation),
  which the agent writes and follows, and which it passes on to its workers;
* :mod:`~elastic.contract.messages`: the typed messages of the local channel between an agent
  and its workers (:mod:`launch.channel` and :mod:`elastic.agent_link`).

(The environment variables an agent sets for its workers are named in :mod:`elastic.env`.)

Nothing here imports the control plane or the worker runtime: a worker-side module never
imports ``membership`` (``tests/unit/test_import_rules.py`` fails if one does), and the
control plane reaches the worker package only through this package and :mod:`elastic.env`.
"""
