"""A NaN/Inf gradient never reaches the Adam state: the step is skipped (and counted) or
the run fails with a message naming the setting, per optim.nonfinite."""

from __future__ import annotations

import pytest
import torch
from reference import tiny_config

from cargohold.cluster.launcher import TrainingSession
from cargohold.services.core.errors import TrainingError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _state(session: TrainingSession) -> list[dict[int, dict[str, torch.Tensor]]]:
    return session.server_snapshots()


def _same(a, b) -> bool:
    return all(torch.equal(x[i][k], y[i][k]) for x, y in zip(a, b) for i in x for k in x[i])


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_nonfinite_gradients_never_change_the_state(ray_local, policy: str) -> None:
    import ray

    def poison_head(worker) -> None:  # nested: Ray pickles it by value into the actor
        """Put an Inf into this worker's chunk of the output head."""
        head = dict(worker.step.model.named_parameters())["lm_head.weight"]
        with torch.no_grad():
            head.to_local().view(-1)[0] = float("inf")

    config = tiny_config(steps=4, optim__nonfinite=policy, state_server__num_servers=2)
    with TrainingSession(config) as session:
        assert not session.step().skipped
        before = _state(session)
        # An Inf in rank 0's output head makes its loss and gradients non-finite, and so
        # the all-reduced global norm on every rank.
        ray.get(session.workers[0].__ray_call__.remote(poison_head))
        if policy == "fail":
            with pytest.raises(TrainingError, match="optim.nonfinite=skip"):
                session.step()
        else:
            report = session.step()
            assert report.skipped and report.applied == 0
        assert _same(before, _state(session)), "a non-finite gradient changed the Adam state"
        assert {int(t["step"]) for snap in _state(session) for t in snap.values()} == {1}
