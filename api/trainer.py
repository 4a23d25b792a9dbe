"""``cargohold.Trainer``: the whole machinery of ``cargohold train`` (Ray actors, FSDP2
workers, state servers with tiers, checkpoints and restarts, validation, metrics) around a
user's own model, loss and data. ``cargohold train`` is this class with the model and data
its config names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_task
from cargohold.cluster.supervise import TrainResult, train
from cargohold.services.core.errors import ConfigError
from cargohold.services.worker.step_report import EvalReport, StepReport
from cargohold.services.worker.task import TrainingTask
from cargohold.user_data import Collate
from cargohold.user_task import LossFunction, ModelFactory, UserTask


class Trainer:
    """Train ``model_fn()`` on ``data`` with ``loss_fn``, as ``config`` says how
    (workers, state servers and tiers, optimizer, steps, checkpoints, metrics)::

        trainer = cargohold.Trainer(make_model, loss_fn, dataset, config, on_step=print)
        result = trainer.fit()  # losses, checkpoints, evaluations

    - ``model_fn()``: any ``nn.Module`` factory. Every process calls it under
      ``torch.device("meta")`` for shapes, and once on the CPU under
      ``torch.manual_seed(config.seed)`` for the initial values (each worker keeps only its
      1/W chunk of them). FSDP2 shards it per block: ``blocks`` names the blocks'
      submodules, by default each member of its largest ``nn.ModuleList`` of one class.
    - ``loss_fn(model, batch)``: the scalar loss of one rank's micro-batch (on the
      worker's device). A step's loss is the mean over ranks and micro-batches.
    - ``data``: a map-style dataset (shuffled per epoch from ``config.data.seed``), an
      iterable dataset (read in order, each rank keeping its own items) or a function
      ``(step, rank, micro) -> batch``; ``config.data.batch_size`` items per rank and
      micro-batch, collated by ``collate`` (``default_collate``). Batches are a pure
      function of the step, so a resumed run continues exactly.
    - ``eval_data``: a map-style held-out dataset, evaluated every ``eval_every_steps``
      steps and after the last.
    - ``on_step(StepReport)``, ``on_eval(EvalReport)``, ``on_checkpoint(Path)``: called
      after each step, each validation and each complete checkpoint.
    - ``config.export_dir``: the trained fp32 weights as ``model.safetensors``, by
      ``named_parameters()`` name (``model.load_state_dict(load_file(...), strict=False)``).
    - ``progress``: a progress bar on stderr (True), or one plain line per step and per
      validation on stdout (False); by default a bar when stderr is a terminal.

    Without ``model_fn``, ``loss_fn`` and ``data``, it trains the model and data the config
    names (what ``cargohold train`` does). Everything that can be checked is checked
    before an actor starts; ConfigError names what is wrong.
    """

    def __init__(
        self,
        model_fn: ModelFactory | None = None,
        loss_fn: LossFunction | None = None,
        data: Any = None,
        config: TrainConfig | None = None,
        *,
        eval_data: Any = None,
        eval_every_steps: int = 0,
        blocks: Sequence[str] | None = None,
        collate: Collate | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        on_eval: Callable[[EvalReport], None] | None = None,
        on_checkpoint: Callable[[Path], None] | None = None,
        progress: bool | None = None,
    ) -> None:
        self.config = config if config is not None else TrainConfig()
        self.task = _task(self.config, model_fn, loss_fn, data, eval_data, eval_every_steps, blocks, collate)
        self.on_step, self.on_eval, self.on_checkpoint = on_step, on_eval, on_checkpoint
        self.progress = sys.stderr.isatty() if progress is None else progress

    def fit(self) -> TrainResult:
        """Run ``config.steps`` steps (from ``checkpoint.resume`` when set); returns the
        losses, step times, checkpoints and validations. TrainingError when a failure
        outlasts ``checkpoint.max_failures`` restarts."""
        line = ProgressLine(self.config.steps, enabled=self.progress)
        try:
            return train(
                self.config,
                on_step=_both(line.step, self.on_step),
                on_eval=_both(line.eval, self.on_eval),
                on_checkpoint=self.on_checkpoint,
                task=self.task,
            )
        finally:
            line.close()


def _task(
    config: TrainConfig,
    model_fn: ModelFactory | None,
    loss_fn: LossFunction | None,
    data: Any,
    eval_data: Any,
    eval_every_steps: int,
    blocks: Sequence[str] | None,
    collate: Collate | None,
) -> TrainingTask:
    own = {"model_fn": model_fn, "loss_fn": loss_fn, "data": data}
    if all(value is None for value in own.values()):
        for name, value in {"eval_data": eval_data, "blocks": blocks, "collate": collate}.items():
            if value is not None:
                raise ConfigError(f"{name} is for a model of your own: give model_fn, loss_fn and data too")
        return config_task(config)
    missing = [name for name, value in own.items() if value is None]
    if missing:
        raise ConfigError(f"model_fn, loss_fn and data go together; {', '.join(missing)} missing")
    for name in ("model_fn", "loss_fn"):
        if not callable(own[name]):
            raise ConfigError(f"{name} must be callable, got {type(own[name]).__name__}")
    if eval_every_steps < 0:
        raise ConfigError(f"eval_every_steps must be >= 0, got {eval_every_steps}")
    if eval_every_steps and eval_data is None:
        raise ConfigError("eval_every_steps is set but there is no eval_data")
    return UserTask(
        config,
        model_fn,  # type: ignore[arg-type]
        loss_fn,  # type: ignore[arg-type]
        data,
        eval_data=eval_data,
        eval_every_steps=eval_every_steps,
        blocks=blocks,
        collate=collate,
    )


def _both(first: Callable[[Any], None], second: Callable[[Any], None] | None) -> Callable[[Any], None]:
    if second is None:
        return first

    def call(report: Any) -> None:
        first(report)
        second(report)

    return call


class ProgressLine:
    """A tqdm bar of steps with the loss, step time and validation on stderr; disabled,
    one plain line per step and per validation on stdout (logs, CI)."""

    def __init__(self, steps: int, *, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=steps, desc="train", unit="step", disable=not enabled, file=sys.stderr)
        self._enabled = enabled
        self._shown: dict[str, str] = {}
        self._skipped = 0

    def step(self, report: StepReport) -> None:
        self._bar.update(1)
        self._shown.update(loss=f"{report.loss:.4f}", step_s=f"{report.seconds:.2f}")
        if report.loss_scale is not None:
            self._shown.update(loss_scale=f"{report.loss_scale:g}")
        if report.skipped:
            self._skipped += 1
            self._shown.update(skipped=str(self._skipped))
        self._bar.set_postfix(self._shown)
        if not self._enabled:
            scale = f" loss_scale {report.loss_scale:g}" if report.loss_scale is not None else ""
            skipped = " update skipped" if report.skipped else ""
            print(f"step {report.step} loss {report.loss:.4f} step_s {report.seconds:.3f}{scale}{skipped}", flush=True)

    def eval(self, report: EvalReport) -> None:
        self._shown.update(eval_loss=f"{report.loss:.4f}", eval_ppl=f"{report.perplexity:.2f}")
        self._bar.set_postfix(self._shown)
        if not self._enabled:
            print(f"eval step {report.step} loss {report.loss:.4f} ppl {report.perplexity:.4f}", flush=True)

    def close(self) -> None:
        self._bar.close()
