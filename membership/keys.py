"""Where a job's membership lives in etcd (see the package docstring for the picture)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_errors import ConfigError

__all__ = ["JobKeys", "validate_job_id"]


def validate_job_id(job_id: str) -> str:
    """Returns ``job_id`` if it can name etcd keys.

    Raises:
        ConfigError: If it is empty or contains ``/``.
    """
    if not job_id or "/" in job_id or job_id.strip() != job_id:
        raise ConfigError(
            f"the job id ({job_id!r}) must be non-empty, without '/' or surrounding spaces; "
            "pass --job-id."
        )
    return job_id


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The etcd keys of one job id, and of one generation (run) of it.

    Attributes:
        prefix: elastic-run's key prefix (``--rdzv-conf key_prefix``, default ``/elastic``).
        job: The job id.
        generation: The run of the job id these keys belong to (0: not chosen yet).
    """

    prefix: str
    job: str
    generation: int = 0

    @property
    def job_root(self) -> str:
        """``{prefix}/{job}/``: every key of the job id, all generations."""
        return f"{self.prefix.rstrip('/')}/{self.job}/"

    @property
    def generation_key(self) -> str:
        """The job id's :class:`~elastic.contract.records.GenerationRecord` (no lease)."""
        return self.job_root + "generation"

    @property
    def runs_range(self) -> tuple[str, str]:
        """``(start, end)`` of every run's keys (``g{n}/...`` for any n), without the
        generation key itself: ``g`` followed by a digit."""
        return self.job_root + "g0", self.job_root + "g:"

    def for_generation(self, generation: int) -> JobKeys:
        """The keys of run ``generation``."""
        return JobKeys(self.prefix, self.job, generation)

    @property
    def root(self) -> str:
        """``{prefix}/{job}/g{generation}/``: every key of this run."""
        if self.generation < 1:
            raise RuntimeError("JobKeys.generation must be chosen before naming run keys")
        return f"{self.job_root}g{self.generation}/"

    @property
    def nodes(self) -> str:
        """Prefix of the node records (one per agent, on the agent's lease)."""
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        """The key of one node record."""
        return self.nodes + node_id

    @property
    def control(self) -> str:
        """Prefix of the small keys every agent follows: world, leader, end."""
        return self.root + "job/"

    @property
    def world(self) -> str:
        """The :class:`~elastic.contract.records.WorldRecord` (written only by CAS)."""
        return self.control + "world"

    @property
    def leader(self) -> str:
        """The leader's node id, on the leader's lease (created only if absent)."""
        return self.control + "leader"

    @property
    def end(self) -> str:
        """The run's :class:`~elastic.contract.records.EndRecord`, on a short linger lease."""
        return self.control + "end"

    @property
    def store(self) -> str:
        """Prefix of the etcd Store that torchrun's agent uses through the plugin handler."""
        return self.root + "store/"
