"""The parts of a run's config that each service takes. Services never see the whole
:class:`~cargohold.cluster.schema.train.TrainConfig` (``tests/test_architecture.py``):
the launcher, the plan, the CLI and the Python API hand them its sections through these.
The worker actor, which receives the whole config from the launcher, hands its sections
down itself.
"""

from __future__ import annotations

from torch import nn

from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.layout import Layout
from cargohold.services.models.spec import ModelSpec
from cargohold.services.worker.model_setup import model_layout
from cargohold.services.worker.sharding import Unit
from cargohold.services.worker.state_port import PortConfig
from cargohold.services.worker.task import ConfigTask, TrainingTask


def model_spec(config: TrainConfig) -> ModelSpec:
    """The model ``config`` names (``model.*`` or ``hf.*``) and its seed."""
    return ModelSpec(gpt=config.model, hf=config.hf, seed=config.seed)


def config_task(config: TrainConfig) -> ConfigTask:
    """The task ``config`` describes: its model, ``data.*`` and ``eval.*``."""
    return ConfigTask(model_spec(config), config.data, config.eval, config.worker.num_workers)


def config_layout(config: TrainConfig, task: TrainingTask | None = None) -> tuple[nn.Module, list[Unit], Layout]:
    """:func:`~cargohold.services.worker.model_setup.model_layout` of ``task`` (by default
    the model the config names) over ``config``'s workers and state servers."""
    return model_layout(task or config_task(config), config.worker, config.state_server.num_servers)


def port_config(config: TrainConfig) -> PortConfig:
    """What a worker's port to the state servers reads from ``config``."""
    return PortConfig(optim=config.optim, push_dtype=config.push_dtype, compute_dtype=config.worker.compute_dtype)
