"""Reads the audit lines of ``inplace_worker.py`` and checks them.

Which attempt of a step is in the final weights: worlds (generations) are totally ordered and
every rank of a world starts from the same state (after the heal), so the latest generation
in which any rank completed step ``s`` is the one whose result the final weights contain; an
earlier completion of ``s`` was abandoned by every survivor (they all redid it). The samples
of that attempt are the ids every rank of that generation logged for ``s`` before its
backward pass (a rank can only complete ``s`` after every rank contributed its gradient).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.training.harness import reference_order


@dataclass(frozen=True)
class Audit:
    gens: list[dict[str, Any]]  # the "gen" records, in file order per process
    batches: list[dict[str, Any]]
    done: list[dict[str, Any]]
    setups: list[dict[str, Any]]  # "setup" records: a worker's time between init and loop
    #: "open" records: a shard opened by a reader of an ElasticShardedStream (elastic.stream)
    opens: list[dict[str, Any]] = field(default_factory=list)

    def pids_by_gen(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = defaultdict(set)
        for g in self.gens:
            out[int(g["gen"])].add(int(g["pid"]))
        return out

    def world_of(self, gen: int) -> int:
        return int(next(g["world"] for g in self.gens if g["gen"] == gen))

    def final_attempts(self) -> dict[int, int]:
        """Step -> the generation whose completion of it is in the final weights."""
        latest: dict[int, int] = {}
        for d in self.done:
            latest[int(d["step"])] = max(latest.get(int(d["step"]), -1), int(d["gen"]))
        return latest

    def completed_by_gen(self) -> dict[int, int]:
        """Generation -> the highest step any rank completed in it."""
        out: dict[int, int] = {}
        for d in self.done:
            out[int(d["gen"])] = max(out.get(int(d["gen"]), -1), int(d["step"]))
        return out

    def redone_steps(self) -> list[int]:
        """Steps completed (by some rank) in more than one generation."""
        gens: dict[int, set[int]] = defaultdict(set)
        for d in self.done:
            gens[int(d["step"])].add(int(d["gen"]))
        return sorted(s for s, g in gens.items() if len(g) > 1)


def read_audit(audit_dir: Path) -> Audit:
    gens: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    setups: list[dict[str, Any]] = []
    opens: list[dict[str, Any]] = []
    for path in sorted(audit_dir.glob("pid*.jsonl")):
        pid = int(path.name.removeprefix("pid").removesuffix(".jsonl"))
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            record.setdefault("pid", pid)  # the writer's (its file's name)
            {"gen": gens, "batch": batches, "done": done, "setup": setups,
             "open": opens}[record["kind"]].append(record)
    return Audit(gens, batches, done, setups, opens)


def check_exactly_once(audit: Audit, *, steps: int, global_batch: int, dataset: int,
                       seed: int, order: Callable[[int], Sequence[int]] | None = None) -> None:
    """Every step 0..steps-1 trained exactly its global batch of stream positions, once.

    ``order(epoch)`` is the epoch's order of sample ids (default: the sampler's, from
    ``dataset`` and ``seed``).
    """
    final = audit.final_attempts()
    assert sorted(final) == list(range(steps)), f"steps completed: {sorted(final)}"
    ids: dict[tuple[int, int], list[int]] = defaultdict(list)
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for b in audit.batches:
        key = (int(b["gen"]), int(b["step"]))
        ids[key].extend(int(i) for i in b["ids"])
        ranks[key].add(int(b["rank"]))
    orders: dict[int, list[int]] = {}
    for step, gen in final.items():
        key = (gen, step)
        assert len(ranks[key]) == audit.world_of(gen), (
            f"step {step} of generation {gen}: ids of ranks {sorted(ranks[key])} only")
        expected = []
        for position in range(step * global_batch, (step + 1) * global_batch):
            epoch = position // dataset
            if epoch not in orders:
                orders[epoch] = (list(order(epoch)) if order is not None
                                 else reference_order(dataset, seed, epoch))
            expected.append(orders[epoch][position % dataset])
        assert sorted(ids[key]) == sorted(expected), (
            f"step {step} (generation {gen}) trained {sorted(ids[key])}, expected "
            f"{sorted(expected)}")
