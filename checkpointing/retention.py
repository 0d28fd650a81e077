"""Which checkpoint directories to delete: a pure function, so its invariants are testable."""

from __future__ import annotations

from collections.abc import Iterable

from checkpointing.layout import parse_dir_name


def _key(name: str) -> tuple[int, int]:
    parsed = parse_dir_name(name)
    if parsed is None:
        raise ValueError(f"Directory name ({name}) is not a checkpoint attempt name.")
    return parsed


def plan_retention(
    committed: Iterable[str],
    uncommitted: Iterable[str],
    *,
    keep_last: int,
    in_flight: str | None = None,
    keep_every: int | None = None,
) -> list[str]:
    """Return the attempt directories to delete, oldest first.

    Deletes committed directories beyond the newest ``keep_last`` (except steps that are a
    multiple of ``keep_every``), and uncommitted ones older than the newest committed one (crash
    leftovers). Never returns the newest committed directory nor ``in_flight``.

    Args:
        committed: Names of directories with a valid commit record.
        uncommitted: Names of attempt directories without one.
        keep_last: How many committed checkpoints to keep, at least 1.
        in_flight: The directory being written now, if any.
        keep_every: Keep committed steps divisible by this for good, if set.

    Raises:
        ValueError: If ``keep_last < 1``, ``keep_every < 1`` or a name is not an attempt name.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last ({keep_last}) must be at least 1; pass 1 or more.")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every ({keep_every}) must be at least 1 or None.")
    done = sorted(set(committed), key=_key)
    pending = sorted(set(uncommitted) - set(done), key=_key)
    doomed: list[str] = []
    for name in done[: max(0, len(done) - keep_last)]:
        if keep_every is not None and _key(name)[0] % keep_every == 0:
            continue
        doomed.append(name)
    if done:
        newest = _key(done[-1])
        doomed.extend(n for n in pending if _key(n) < newest)
    protected = {in_flight} | ({done[-1]} if done else set())
    return sorted((n for n in doomed if n not in protected), key=_key)
