"""What a run trains, apart from how: the model, its initial values, its FSDP2 blocks, the
loss of a batch, and the data. The launcher and every worker ask a :class:`TrainingTask`.

:class:`ConfigTask` is the task a config describes (the built-in GPT or a transformers
causal LM, ``data.*`` and ``eval.*``); ``cargohold.Trainer`` gives workers a user's own
model factory, loss and dataset through the same protocol. Workers receive the task
pickled by Ray, so a task holds only what every process can rebuild its part from.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.eval import EvalConfig
from cargohold.services.core.errors import TrainingError
from cargohold.services.core.layout import Layout
from cargohold.services.data.batches import Batch, DataSource
from cargohold.services.data.evaluation import EvalSource, open_eval_set
from cargohold.services.data.sources import open_source
from cargohold.services.models.blocks import transformer_blocks
from cargohold.services.models.build import buffer_values, build_model, parameter_values
from cargohold.services.models.spec import ModelSpec

ParameterValues = Callable[[Iterable[str]], Iterator[tuple[str, torch.Tensor]]]
"""Full fp32 initial values of the named parameters, one at a time."""

BatchLoss = Callable[[nn.Module, Any, torch.device], torch.Tensor]
"""The scalar loss of one micro-batch: ``(model, batch, device)``; it moves the batch."""


class TrainingTask(Protocol):
    """The model, loss and data of a run. Every method is called in every process that
    needs it (the launcher to check and lay out, each worker to train its share)."""

    eval_every_steps: int
    """Validate every this many steps, and after the last; 0: after the last only."""

    def build(self) -> nn.Module:
        """The model in fp32; under ``torch.device("meta")`` shapes only."""
        ...

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(qualified name, module)`` of each FSDP2 unit below the root, in forward order."""
        ...

    def initial_values(self, model_on_meta: nn.Module) -> ParameterValues:
        """Full fp32 initial values of named parameters, the same in every process; what
        it holds is let go once the worker's segments are registered."""
        ...

    def buffer_values(self, model_on_meta: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every buffer's value, which a model built on the meta device lacks."""
        ...

    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        """The scalar loss of one rank's micro-batch ``batch`` (moved to ``device``)."""
        ...

    def open_data(self) -> DataSource:
        """The training batches, a pure function of (step, rank, micro-batch)."""
        ...

    def open_eval(self) -> EvalSource | None:
        """The held-out batches, or None when the run does not validate."""
        ...

    def export(self, layout: Layout, flat: torch.Tensor, directory: Path) -> Path:
        """Write the fp32 master weights ``flat`` for use outside cargohold."""
        ...


class ConfigTask:
    """The task a config describes: ``model``/``hf`` (``model``), ``data.*`` and ``eval.*``
    (``held_out``), read by ``num_workers`` workers."""

    def __init__(self, model: ModelSpec, data: DataConfig, held_out: EvalConfig, num_workers: int) -> None:
        self.model = model
        self.data = data
        self.held_out = held_out
        self.num_workers = num_workers
        self.eval_every_steps = held_out.every_steps
        self._checked: set[str] = set()
        """What this task's data checks read whole ("data", "eval": a token file's every
        id) in the launcher, so that the workers it is pickled to read only their batches."""

    def build(self) -> nn.Module:
        return build_model(self.model, self.data)

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return transformer_blocks(model)

    def initial_values(self, model_on_meta: nn.Module) -> ParameterValues:
        return lambda names: parameter_values(self.model, model_on_meta, names)

    def buffer_values(self, model_on_meta: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        return buffer_values(self.model.seed, model_on_meta)

    def loss(self, model: nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
        return model_loss(model, batch, device)

    def open_data(self) -> DataSource:
        source = open_source(self.model, self.data, self.num_workers, check_token_file="data" not in self._checked)
        self._checked.add("data")
        return source

    def open_eval(self) -> EvalSource | None:
        held_out = open_eval_set(
            self.model, self.data, self.held_out, self.num_workers, check_token_file="eval" not in self._checked
        )
        self._checked.add("eval")
        return held_out

    def export(self, layout: Layout, flat: torch.Tensor, directory: Path) -> Path:
        from cargohold.cluster.export import export_weights  # the export layer sits above services

        return export_weights(self.model, self.data, layout, flat, directory)


def model_loss(model: nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """The loss the config's models compute themselves: ``model(inputs, targets)[1]``,
    with the position ids of rows of whole documents."""
    if batch.position_ids is None:
        _, loss = model(batch.inputs.to(device), batch.targets.to(device))
        return loss
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise TrainingError(
            f"{type(model).__name__}.forward takes no position_ids, which rows of whole documents need "
            "(data.packing: documents); add the argument or set data.packing: stream"
        )
    _, loss = model(batch.inputs.to(device), batch.targets.to(device), position_ids=batch.position_ids.to(device))
    return loss


def scalar_loss(loss: object, step: int | None) -> torch.Tensor:
    """A task's loss of a batch as a 0-d tensor; refused unless it is a floating-point
    tensor of one element, naming data step ``step`` (None: an evaluation)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"step {step}" if step is not None else "evaluation"
        got = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TrainingError(f"{what}: the loss function must return a floating-point scalar tensor, got {got}")
    return loss.reshape(())
