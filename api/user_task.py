"""A user's model factory, loss and data as a :class:`~cargohold.services.worker.task.TrainingTask`.

Ray pickles the task (cloudpickle: closures and lambdas travel) to every worker, which
builds the model on the meta device, shards it with FSDP2 per block and materialises only
its own chunks. Initial values come from one CPU build of ``model_fn()`` under
``torch.manual_seed(seed)``, the same in every process, held only while the shards are
registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.durable import replace_durably
from cargohold.services.core.errors import ConfigError, ExportError
from cargohold.services.core.layout import Layout, gather_params
from cargohold.services.data.batches import BatchShape, DataSource
from cargohold.services.models.blocks import transformer_blocks
from cargohold.services.worker.task import ParameterValues
from cargohold.user_data import Collate, HeldOutBatches, UserBatch, open_user_data, to_device

ModelFactory = Callable[[], nn.Module]
LossFunction = Callable[[nn.Module, Any], torch.Tensor]
WEIGHTS_FILE = "model.safetensors"


class UserTask:
    def __init__(
        self,
        config: TrainConfig,
        model_fn: ModelFactory,
        loss_fn: LossFunction,
        data: Any,
        *,
        eval_data: Any = None,
        eval_every_steps: int = 0,
        blocks: Sequence[str] | None = None,
        collate: Collate | None = None,
    ) -> None:
        self.config = config
        self.model_fn, self.loss_fn, self.data, self.eval_data = model_fn, loss_fn, data, eval_data
        self.eval_every_steps = eval_every_steps
        self.block_names = list(blocks) if blocks is not None else None
        self.collate = collate

    def build(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # construction draws torch's default inits
            model = self.model_fn()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
        return model

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        if self.block_names is None:
            return transformer_blocks(model)
        found = []
        for name in self.block_names:
            try:
                found.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ConfigError(f"blocks: the model has no submodule {name!r}") from None
        return found

    def initial_values(self, model_on_meta: nn.Module) -> ParameterValues:
        """Every parameter's initial value from one CPU build, for the whole registration."""
        params = dict(self._initial_model().named_parameters())
        return lambda names: ((name, params[name].detach().to(torch.float32)) for name in names)

    def buffer_values(self, model_on_meta: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((name, buffer.detach()) for name, buffer in self._initial_model().named_buffers())

    def loss(self, model: nn.Module, batch: UserBatch, device: torch.device) -> torch.Tensor:
        return self.loss_fn(model, to_device(batch.data, device))

    def open_data(self) -> DataSource:
        return open_user_data(self.data, batch_shape_of(self.config), seed=self.config.data.seed, collate=self.collate)

    def open_eval(self) -> HeldOutBatches | None:
        if self.eval_data is None:
            return None
        return HeldOutBatches(
            self.eval_data,
            world_size=self.config.worker.num_workers,
            batch_size=self.config.eval.batch_size or self.config.data.batch_size,
            max_batches=self.config.eval.max_batches,
            collate=self.collate,
        )

    def export(self, layout: Layout, flat: torch.Tensor, directory: Path) -> Path:
        """``model.safetensors``: the fp32 master weights by ``named_parameters()`` name,
        for ``model.load_state_dict(safetensors.torch.load_file(...), strict=False)``."""
        gathered = gather_params(layout, flat.cpu())
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with replace_durably(directory / WEIGHTS_FILE) as temporary:
                save_file({name: t.contiguous() for name, t in gathered.items()}, temporary, metadata={"format": "pt"})
        except OSError as error:
            raise ExportError(f"cannot write the export to export_dir={str(directory)!r}: {error}") from error
        return directory

    def _initial_model(self) -> nn.Module:
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            return self.build()


def batch_shape_of(config: TrainConfig) -> BatchShape:
    """The global batch of a step: ``data.batch_size`` items per rank and micro-batch."""
    return BatchShape(
        world_size=config.worker.num_workers,
        batch_size=config.data.batch_size,
        seq_len=1,  # a user's items have whatever shape they have
        micro_batches=config.data.micro_batches,
    )
