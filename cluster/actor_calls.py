"""Waiting on Ray actor calls the way a run needs: the first failure ends the wait, an
actor's death or error becomes a TrainingError naming what was being done (a ConfigError
stays one: it still exits with status 2)."""

from __future__ import annotations

import time

import ray

from cargohold.services.core.errors import ConfigError, TrainingError


def get_all(refs, timeout: float | None, what: str):
    """ray.get that fails as soon as any one call fails, instead of waiting in list order
    for calls that may be blocked in a collective with the failed one."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                raise TrainingError(f"timed out after {timeout}s {what}")
            ray.get(ready[0])
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise TrainingError(f"an actor died while {what}: {error}") from error
    except ray.exceptions.RayTaskError as error:
        cause = error.cause if error.cause else error
        if isinstance(cause, ConfigError):  # found where the config meets the node: still exit status 2
            raise ConfigError(f"{what}: {cause}") from error
        raise TrainingError(f"{what} failed: {cause}") from error
