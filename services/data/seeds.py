"""Generator seeds derived from the run's seed and a step: stable across processes,
platforms and Python versions, so a resumed run draws what the uninterrupted one did."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit generator seed from ``parts`` (e.g. seed and step), stable across
    processes and versions.

    Python's ``hash`` of a tuple is not guaranteed stable across versions or platforms,
    and ``seed + step`` would make run (seed, step + 1) repeat run (seed + 1, step).
    """
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def dropout_seed(seed: int, step: int, rank: int, micro: int = 0) -> int:
    """The seed of the random draws (dropout) rank ``rank`` makes in micro-batch ``micro``
    of step ``step``: a function of the step, not of how many steps the process has run,
    so a resumed run draws what the uninterrupted one did. (Micro-batch 0 keeps the seed
    it had before accumulation existed.)"""
    if micro == 0:
        return stable_seed("dropout", seed, step, rank)
    return stable_seed("dropout", seed, step, rank, micro)
