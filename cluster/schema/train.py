"""The root of a run's configuration, and the checks that read more than one section."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cargohold.cluster.schema.checks import check_output_folder, positive
from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.eval import EvalConfig
from cargohold.cluster.schema.model import GPTConfig, HFModelConfig
from cargohold.cluster.schema.optim import OptimConfig
from cargohold.cluster.schema.run import CheckpointConfig, ClusterConfig, MetricsConfig, SecurityConfig
from cargohold.cluster.schema.server import StateServerConfig
from cargohold.cluster.schema.worker import DType, WorkerConfig
from cargohold.services.core.errors import ConfigError

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A run id names folders (NVMe tier, shared memory) and Ray actors: one path component."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The root of a run's configuration."""

    run_id: str | None = None
    """Names the run on the state servers; None derives one from the time."""
    steps: int = 50
    seed: int = 0
    """Seeds model initialisation (identical on every worker)."""
    export_dir: str | None = None
    """Write the trained fp32 weights here as safetensors at the end of the run: for an `hf`
    model a folder `transformers.AutoModelForCausalLM.from_pretrained` loads, with its
    generation config, for the built-in GPT `model.safetensors` and `cargohold_gpt.json`
    (`cargohold.cluster.export.load_exported_gpt` loads them); beside them the tokenizer the
    data was tokenized with (`AutoTokenizer.from_pretrained` loads it). None exports nothing."""
    model: GPTConfig = field(default_factory=GPTConfig)
    hf: HFModelConfig = field(default_factory=HFModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    state_server: StateServerConfig = field(default_factory=StateServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def push_dtype(self) -> DType:
        """The dtype gradients go to the state servers in: `tuning.worker.grad_wire_dtype`, or
        float32 when micro-batches are accumulated, since their sum is kept in fp32 (as
        FSDP2 sums gradients into fp32 parameters' `.grad`) and rounding it to the wire
        dtype would lose what the accumulation added."""
        return "float32" if self.data.micro_batches > 1 else self.worker.grad_wire_dtype

    def __post_init__(self) -> None:
        positive("steps", self.steps)
        if self.export_dir == "":
            raise ConfigError("export_dir must be a folder path or null, got an empty string")
        if self.export_dir is not None:
            check_output_folder("export_dir", self.export_dir)
        _check_separate_folders(self)
        _check_run_id(self.run_id)
        self.eval.check_format(self.data.format)
        _check_float16(self)
        _check_device_state(self)
        last_port = (self.metrics.port or 0) + self.state_server.num_servers + self.worker.num_workers
        if self.metrics.port and last_port > 65535:
            raise ConfigError(f"metrics.port {self.metrics.port} leaves no room for every actor (up to {last_port})")


def _check_float16(config: TrainConfig) -> None:
    """fp16 compute skips the steps whose scaled gradients overflow, and only gradients
    computed with a loss scale may travel in fp16 (unscaled ones would underflow there)."""
    worker, optim = config.worker, config.optim
    if worker.compute_dtype == "float16" and optim.nonfinite != "skip":
        raise ConfigError(
            f"worker.compute_dtype=float16 needs optim.nonfinite=skip, got {optim.nonfinite!r}: dynamic loss "
            "scaling skips the steps whose scaled gradients overflow and lowers the scale"
        )
    if worker.grad_wire_dtype == "float16" and worker.compute_dtype != "float16":
        raise ConfigError(
            f"tuning.worker.grad_wire_dtype=float16 needs worker.compute_dtype=float16 (got {worker.compute_dtype}): "
            "only gradients computed with a loss scale keep their small values in fp16"
        )


def _check_device_state(config: TrainConfig) -> None:
    """GPU workers keep their share of the optimizer in fp32: the bf16 and 8-bit kinds'
    codecs run on the state servers' CPUs."""
    worker, state_dtype = config.worker, config.optim.state_dtype
    if worker.on_gpus and worker.optimizer_on_device_fraction and state_dtype != "float32":
        raise ConfigError(
            "worker.optimizer_on_device_fraction on GPU workers keeps fp32 state: set optim.state_dtype=float32 "
            f"(got {state_dtype}) or keep the whole optimizer on the state servers (fraction 0)"
        )


def _check_run_id(run_id: str | None) -> None:
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run_id {run_id!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (it names folders and actors)"
        )


def _check_separate_folders(config: TrainConfig) -> None:
    """Refuse folders of a run that are one another or one inside another: pruning old
    checkpoints would delete an export inside ``checkpoint.dir``, and the teardown sweep of
    a tier or weights folder a checkpoint or an export inside it."""
    folders = [("checkpoint.dir", config.checkpoint.dir), ("export_dir", config.export_dir)] + [
        (f"state_server.tier.nvme_paths[{i}]", path) for i, path in enumerate(config.state_server.tier.nvme_paths)
    ]
    folders.append(("worker.weights_nvme_path", config.worker.weights_nvme_path))
    named = [(key, path, Path(path).expanduser().resolve()) for key, path in folders if path]
    for index, (key, path, where) in enumerate(named):
        for other_key, other_path, other in named[index + 1 :]:
            if key.startswith("state_server") and other_key.startswith("state_server"):
                continue  # tier paths share nothing: each holds its own partition files
            if where == other or where.is_relative_to(other) or other.is_relative_to(where):
                raise ConfigError(
                    f"{key} {path!r} and {other_key} {other_path!r} overlap (one is, or is inside, the other); "
                    "give each its own folder"
                )
