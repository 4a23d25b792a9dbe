"""One typed configuration for a training run: dataclasses per component, loaded from
YAML with ``key.path=value`` overrides. Unknown keys and ill-typed values are refused
with the full dotted key in the message.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cargohold.cluster.config_eval import EvalConfig
from cargohold.cluster.config_model import GPTConfig, HFModelConfig
from cargohold.cluster.config_optim import OptimConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.core.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes
from cargohold.services.tiers.partitions import elements_per_partition

DType = Literal["float32", "bfloat16", "float16"]


HostAllocatorSetting = Literal["auto", "mimalloc", "glibc"]
"""``worker.host_allocator`` (`services/worker/host_allocator.py`)."""
DataFormat = Literal["bytes", "tokens", "text", "jsonl", "chat", "hf_dataset"]
TEXT_FIELDS = {"jsonl": "text", "hf_dataset": "text", "chat": "messages"}
"""The record field each format reads when ``data.field`` is not set."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """What the model trains on (docs/data.md). Every file is local; nothing is downloaded."""

    format: DataFormat = "bytes"
    """bytes: byte-level text (ids 0-255; the demo). tokens: a pre-tokenized `.bin`
    (raw `data.token_dtype`) or `.npy` file, memory-mapped. text: a text file, or a folder
    of `*.txt` files, one document each. jsonl: one JSON object a line, its `data.field` a
    document. chat: one JSON object a line, its `data.field` a list of messages rendered
    with the tokenizer's chat template; the loss counts the assistant's tokens only.
    hf_dataset: a Hugging Face `datasets` folder (`save_to_disk`), or `.parquet`/`.arrow`
    files (needs the `datasets` extra). text, jsonl, chat and hf_dataset are tokenized
    with `data.tokenizer` and packed, an EOS token after each document."""
    path: str | None = None
    """The file or folder `data.format` reads (every format but bytes)."""
    corpus_path: str | None = None
    """bytes only: a text file to train on; None generates the built-in corpus."""
    corpus_bytes: int = 2_000_000
    """bytes only: size of the generated corpus when ``corpus_path`` is None."""
    batch_size: int = 8
    """Sequences per worker per micro-batch; a step's global batch is this times
    `worker.num_workers` times `data.micro_batches`."""
    micro_batches: int = 1
    """Micro-batches each worker runs forward and backward per step, their gradients summed
    (gradient accumulation) before the one push to the state servers and the one update:
    a larger global batch in the activation memory of one micro-batch."""
    block_size: int | None = None
    """Tokens per training sequence; None takes the model's context length (`model.block_size`,
    or an `hf` model's `max_position_embeddings`)."""
    seed: int = 1234
    """Seeds which sequences each step draws (a pure function of seed and step)."""
    tokenizer: str | None = None
    """A local folder with the tokenizer files (`save_pretrained` output) for text, jsonl, chat
    and hf_dataset; None takes `hf.checkpoint_dir`, else the folder of `hf.config_path`."""
    field: str | None = None
    """The record field that holds a document (jsonl, hf_dataset; default "text") or a
    conversation (chat; default "messages")."""
    split: str = "train"
    """hf_dataset: the split to read when the folder holds several (a `DatasetDict`)."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """tokens: the dtype of a `.bin` file's ids (a `.npy` file states its own); uint16 holds
    a vocabulary of up to 65536 ids."""
    cache_dir: str | None = None
    """Where tokenized data is kept, keyed by the data's content, the tokenizer's files and
    these settings, so that another run does not tokenize again; None: ~/.cache/cargohold/data."""
    packing: Literal["auto", "stream", "documents"] = "auto"
    """How training sequences are made of the documents (text, jsonl, chat, hf_dataset).
    stream: back to back, sequences cut at any offset (no padding, but a sequence may start
    inside a document and attend across an EOS into the one before). documents: each
    sequence holds whole documents (best-fit decreasing), padded, its position ids
    restarting and attention confined to each document (data.overlong says what happens
    to one longer than a sequence). auto: documents for chat, stream otherwise."""
    overlong: Literal["truncate", "drop", "split", "error"] = "truncate"
    """With whole documents: one longer than data.block_size + 1 tokens is truncated (its
    start kept), dropped, or split into sequence-sized pieces, each trained as a document;
    the counts are logged before training. A conversation (or piece) left without a counted
    target, an assistant token, is dropped and counted. error: any such document refuses
    the data before training starts, the first few named by file and line."""

    def __post_init__(self) -> None:
        _positive("data.corpus_bytes", self.corpus_bytes)
        _positive("data.batch_size", self.batch_size)
        if self.micro_batches < 1:
            raise ConfigError(f"data.micro_batches must be an integer >= 1, got {self.micro_batches}")
        if self.block_size is not None:
            _positive("data.block_size", self.block_size)
        if self.format == "bytes":
            if self.path is not None:
                raise ConfigError("data.path is not read with data.format=bytes; name a text file in data.corpus_path")
        else:
            if self.corpus_path is not None:
                raise ConfigError(f"data.corpus_path is for data.format=bytes; with {self.format} set data.path")
            if self.path is None:
                raise ConfigError(f"data.path must name the data to read with data.format={self.format}")
            if not Path(self.path).expanduser().exists():
                raise ConfigError(f"data.path {self.path!r} does not exist (a local file or folder)")
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ConfigError(f"data.tokenizer {self.tokenizer!r} is not a folder (a local save_pretrained output)")
        if self.field == "":
            raise ConfigError("data.field must be a field name or null, got an empty string")
        if self.cache_dir:
            _check_output_folder("data.cache_dir", self.cache_dir)
        if self.packing == "documents" and self.format in ("bytes", "tokens"):
            raise ConfigError(
                f"data.packing=documents needs documents; data.format={self.format} has none (use text, jsonl, "
                "chat or hf_dataset, or data.packing=stream)"
            )

    @property
    def whole_documents(self) -> bool:
        """Sequences are made of whole documents (data.packing, auto: chat)."""
        return self.packing == "documents" or (self.packing == "auto" and self.format == "chat")

    @property
    def record_field(self) -> str:
        """The field jsonl, chat and hf_dataset records are read from."""
        return self.field or TEXT_FIELDS.get(self.format, "text")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    num_workers: int = 2
    """Data-parallel workers, one per accelerator (CPU processes when there is none)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA + NCCL when the worker sees a GPU, else CPU + gloo."""
    compute_dtype: DType = "float32"
    """Dtype of the weights the worker holds and computes in. float16 (GPUs without bf16:
    T4, V100) scales the loss dynamically (`optim.loss_scale`); it needs
    `optim.nonfinite: skip`, since the steps whose scaled gradients overflow are skipped."""
    grad_wire_dtype: DType = "float32"
    """Dtype gradients are reduced among workers and pushed to state servers in; float16
    only with `worker.compute_dtype: float16` (the gradients then carry the loss scale)."""
    reshard_after_forward: bool = True
    """Free each block's gathered weights after its forward and gather them again for
    backward (ZeRO-3); false keeps them from forward to backward (ZeRO-2-like: faster,
    but every block's full weights stay resident during the step)."""
    kept_gathered_units: int = 1
    """With `reshard_after_forward`: the last this many units stay gathered from their
    forward to their backward, so their backward skips the all-gather. The last unit's
    backward comes right after its forward (FSDP2 would gather it again at once), so 1
    costs no memory; each one more holds one more unit gathered through the middle of
    the step (`cargohold plan` counts them). DeepSpeed's ZeRO-3 keeps parameters the same
    way (`stage3_max_reuse_distance`, in elements)."""
    shared_memory_collectives: Literal["auto", "off"] = "auto"
    """auto: CPU workers that all run on one host do FSDP2's all-gathers and
    reduce-scatters through shared memory (each worker's region, a sealed memfd, mapped by
    the others) instead of gloo's loopback TCP: one copy in and one out per byte, no
    socket traffic; workers on several hosts, or on GPUs (NCCL), keep their backend's.
    off: always gloo's."""
    offload_params: bool = False
    """Keep the sharded weights and gradients in host memory (pinned on GPU nodes) and copy
    each block to the device only for its forward and backward (ZeRO-Infinity's
    offload_param): device memory then holds the blocks in flight and the activations.
    On CPU workers the device is host memory already: nothing moves (the path still runs)."""
    weights_nvme_path: str | None = None
    """A folder on NVMe for the weights (ZeRO-Infinity's offload_param: nvme): each block's
    chunks live in a file under `<path>/<run_id>/worker-<rank>/` and are read into host
    memory just ahead of the block's forward and again ahead of its backward, and written
    after its update; host memory holds `weight_window` blocks and the root at a time.
    null keeps every chunk in host (or device) memory. On GPU workers it implies
    offload_params. Not checkpoint.dir, export_dir or a tier path, nor inside or around one;
    probed before Ray on a local run (a file, a read-only or pseudo filesystem exits 2)."""
    weight_window: int = 3
    """With weights_nvme_path: blocks whose chunks may be in host memory at once (the one in
    use and those read ahead); at least 2, since backward gathers the next block while one
    computes."""
    max_unit_params: int = 0
    """0: one FSDP2 unit per transformer block, every other parameter (embeddings, norms,
    head) in the root unit. Above 0: no unit larger than this many parameters where the
    model allows it (torchtitan's layout): a block above it is split below (its attention
    and MLP, or their projections), and the embeddings and the head are units of their
    own; norms stay in the root. What a step gathers on the device, the gradients it
    reduces and its temporaries, the exchange slots and the weight window are then sized
    by the largest unit, not by a block or the root: set it for blocks too large for the
    device (a 175B block holds 1.8B parameters). Checkpoints resume under any value."""
    activation_checkpointing: Literal["off", "blocks"] = "off"
    """blocks: keep only each transformer block's input in forward and recompute the rest
    in backward (torch's activation checkpointing), trading compute for memory."""
    delayed_update: bool = False
    """One-step delayed parameter update (ZeRO-Offload's DPU): step t computes on the
    weights of update t-2 while update t-1 finishes. Hides the update; changes the
    optimisation trajectory (see docs/benchmarks.md)."""
    delayed_update_after_steps: int = 0
    """With delayed_update, train this many data steps normally first (ZeRO-Offload's
    warm-up): stale gradients hurt most early, while the loss falls fast."""
    exchange_slots: int = 3
    """Host buffers of one unit's part of the worker's range (its gradient out, its
    updated weights back) that transfers to the state servers go through. More slots let
    more units' transfers overlap backward; each costs the largest unit's local elements
    x (wire + compute dtype) bytes. Backward waits when all are in use."""
    shared_memory: Literal["auto", "off"] = "auto"
    """auto: exchange gradients and weights with state servers on the same node through
    shared memory (a sealed memfd the server maps) instead of gRPC streams; a GPU worker
    page-locks it, so its copies to and from the device are DMA; off: always stream over
    gRPC."""
    cpus: float = 1.0
    """Ray CPUs reserved per worker."""
    gpus: float = 0.0
    """Ray GPUs reserved per worker (set 1 on GPU nodes)."""
    torch_threads: int = 1
    """Intra-op threads of each worker's torch."""
    optimizer_on_device_fraction: float = 0.0
    """The share of each worker's range whose AdamW state (fp32 master weights and moments)
    the worker keeps on its own device and updates there with torch's fused AdamW; the
    state servers hold and update the rest (Megatron's `optimizer_offload_fraction` is 1
    minus this). Each unit's first share of the worker's chunk is cut off (to 64
    elements), so every unit's push shrinks alike. On CPU workers the device is the
    worker's own memory and cores, and the run is bitwise the same as with the state all
    on the servers; a GPU's CUDA kernel rounds otherwise than the servers' CPU kernel, and
    keeps fp32 state only (`optim.state_dtype: float32`). It costs device memory (the
    state's bytes per parameter, plus a staged gradient with clipping): `cargohold plan
    --device-memory` prints the largest share that fits what the step leaves over.
    Checkpoints hold every segment whoever updates it, and resume under any other share."""
    host_allocator: HostAllocatorSetting = "auto"
    """The C allocator of each worker's process, for the buffers a step frees and allocates
    again (every unit's gathered weights, gradients and activations). "mimalloc" keeps them
    for the next step: on a 100M-parameter model steps 20% shorter than "glibc", at 1.3
    against 1.1 GiB of resident memory a worker (docs/benchmarks.md). "glibc" maps each large
    buffer (on transparent huge pages) and returns it when freed: the least resident
    memory, each step faulting its buffers in again (`services/worker/host_allocator.py`). "auto":
    glibc where the run has one host budget (`cluster.host_memory_bytes`: host memory is
    what is short there), mimalloc otherwise. `cargohold plan` counts what mimalloc keeps.
    The driver's environment wins (``LD_PRELOAD``, ``MIMALLOC_*``, ``MALLOC_*``)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray custom resources each worker's bundle asks for (pins workers to nodes)."""

    def __post_init__(self) -> None:
        _positive("worker.num_workers", self.num_workers)
        _positive("worker.torch_threads", self.torch_threads)
        _positive("worker.exchange_slots", self.exchange_slots)
        if self.weight_window < 2:
            raise ConfigError(f"worker.weight_window must be an integer >= 2, got {self.weight_window}")
        if self.weights_nvme_path == "":
            raise ConfigError("worker.weights_nvme_path must name a folder or be null, got an empty string")
        if self.weights_nvme_path is not None:
            _check_output_folder("worker.weights_nvme_path", self.weights_nvme_path)
        _non_negative("worker.delayed_update_after_steps", self.delayed_update_after_steps)
        _non_negative("worker.max_unit_params", self.max_unit_params)
        _non_negative("worker.kept_gathered_units", self.kept_gathered_units)
        _non_negative("worker.cpus", self.cpus)
        _non_negative("worker.gpus", self.gpus)
        if not 0.0 <= self.optimizer_on_device_fraction <= 1.0:
            raise ConfigError(
                f"worker.optimizer_on_device_fraction must be in [0, 1], got {self.optimizer_on_device_fraction}"
            )


@dataclass(kw_only=True, slots=True)
class TierConfig:
    """Where a state server keeps its optimizer state: RAM, spilling to NVMe files when a
    RAM budget is set."""

    nvme_paths: list[str] = field(default_factory=list)
    """Directories for partition files, one per drive (no RAID needed); partitions are spread
    round-robin over them, under `<path>/<run_id>/server-<i>/`."""
    ram_budget_bytes: int | None = None
    """Hard limit on the memory a state server's optimizer state may use, staging buffers
    included; null keeps all state in RAM."""
    partition_bytes: int = 64 << 20
    """Optimizer state (12 bytes per parameter) per partition, the unit that moves between RAM
    and disk; 16-256 MiB suits NVMe."""
    buffer_count: int = 3
    """Staging buffers of one partition each that disk partitions stream through: 2
    double-buffers, 3 overlaps a read, an update and a write."""
    io_threads: int = 4
    """Threads issuing the NVMe tier's reads and writes."""
    direct_io: Literal["auto", "on", "off"] = "auto"
    """O_DIRECT for partition files: auto uses it where the filesystem accepts it, on requires it, off never uses it."""

    def __post_init__(self) -> None:
        _positive("state_server.tier.partition_bytes", self.partition_bytes)
        if self.partition_bytes < 4096:
            raise ConfigError(f"state_server.tier.partition_bytes must be >= 4096, got {self.partition_bytes}")
        if self.buffer_count < 2:
            raise ConfigError(f"state_server.tier.buffer_count must be >= 2, got {self.buffer_count}")
        _positive("state_server.tier.io_threads", self.io_threads)
        if any(not p for p in self.nvme_paths):
            raise ConfigError("state_server.tier.nvme_paths must not contain an empty path")
        if len(set(self.nvme_paths)) != len(self.nvme_paths):
            raise ConfigError(f"state_server.tier.nvme_paths lists a path twice: {self.nvme_paths}")
        if self.ram_budget_bytes is None:
            return
        _positive("state_server.tier.ram_budget_bytes", self.ram_budget_bytes)
        if not self.nvme_paths:
            raise ConfigError(
                "state_server.tier.ram_budget_bytes is set but state_server.tier.nvme_paths is empty; "
                "name at least one directory for the state that does not fit"
            )
        staging = self.staging_bytes()
        if self.ram_budget_bytes < staging:
            raise ConfigError(
                f"state_server.tier.ram_budget_bytes={self.ram_budget_bytes} cannot hold the "
                f"{self.buffer_count} staging buffers ({staging} bytes); raise it, or lower "
                "state_server.tier.partition_bytes or state_server.tier.buffer_count"
            )

    def staging_bytes(self) -> int:
        """Memory of the staging buffers: ``buffer_count`` partitions in their file layout,
        and as many buffers for a partition's staged gradient (fp32 at most)."""
        elements = elements_per_partition(self.partition_bytes)
        return self.buffer_count * (FileLayout(elements).file_bytes + gradient_file_bytes(elements, 4))


@dataclass(kw_only=True, slots=True)
class StateServerConfig:
    num_servers: int = 1
    """State servers; each owns a contiguous range of the flat parameter buffer."""
    cpus: float = 1.0
    """Ray CPUs reserved per state server."""
    torch_threads: int = 1
    """Threads the CPU Adam update runs on."""
    bind_host: str | None = None
    """Address the gRPC and metrics servers bind; None binds the node's own IP. A wildcard
    (0.0.0.0, ::) needs `allow_wildcard_bind`."""
    allow_wildcard_bind: bool = False
    """Let `bind_host` be a wildcard address, serving on every interface of the node (a
    warning is logged): only behind a network that admits nobody else."""
    rpc_threads: int = 8
    """gRPC handler threads per state server."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per streamed message, or per checksummed chunk on the bulk socket; between 4
    KiB and 32 MiB."""
    data_plane: Literal["socket", "grpc"] = "socket"
    """How gradients and weights travel between workers and state servers on other nodes:
    `socket`, over a TCP socket each server opens beside its gRPC port (a port of its own,
    on the same host, chosen free), each transfer granted over gRPC with the same token,
    TLS and limits; `grpc`, in chunks of gRPC streams (about half as fast). Workers on a
    server's own node use shared memory either way."""
    rpc_timeout_s: float = 300.0
    """Deadline of each call from a worker."""
    max_concurrent_calls: int = 1024
    """Calls a state server admits at once (health checks aside); the next is refused at
    once with RESOURCE_EXHAUSTED, not queued. A worker has at most 16 calls in flight, so
    keep this at least 16 x the workers that call one server; at least `rpc_threads`."""
    message_timeout_s: float = 60.0
    """A call whose peer sends no message, or takes none, for this long is cancelled (the
    server's own work between messages does not count)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray custom resources each state server's bundle asks for."""
    tier: TierConfig = field(default_factory=TierConfig)

    def __post_init__(self) -> None:
        _positive("state_server.num_servers", self.num_servers)
        _positive("state_server.torch_threads", self.torch_threads)
        _positive("state_server.rpc_threads", self.rpc_threads)
        _non_negative("state_server.cpus", self.cpus)
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(
                f"state_server.chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}, "
                f"got {self.chunk_bytes}"
            )
        _positive("state_server.rpc_timeout_s", self.rpc_timeout_s)
        if self.max_concurrent_calls < self.rpc_threads:
            raise ConfigError(
                f"state_server.max_concurrent_calls ({self.max_concurrent_calls}) must be at least "
                f"state_server.rpc_threads ({self.rpc_threads}): threads beyond it would never run a call"
            )
        _positive("state_server.message_timeout_s", self.message_timeout_s)
        if self.bind_host in WILDCARD_HOSTS and not self.allow_wildcard_bind:
            raise ConfigError(
                f"state_server.bind_host {self.bind_host!r} serves every interface of the node; "
                "bind the node's own address (null) or set state_server.allow_wildcard_bind=true"
            )


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    address: str | None = None
    """None starts a Ray cluster in-process; "auto" joins the running one (ray job submit)."""
    num_cpus: int | None = None
    """Logical CPUs of the in-process cluster; None sizes it to fit the run."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy over the worker and state-server bundles."""
    startup_timeout_s: float = 120.0
    """How long to wait for the placement group and every actor to be ready."""
    host_memory_bytes: int | None = None
    """Host RAM cargohold's processes of the run may use together (the driver, the workers,
    the state servers; each process's runtime counted; Ray's own processes, its GCS,
    raylets and agents, are not, so leave them room): one budget the planner splits. Each
    worker and state server takes what the model and config fix (lowering
    worker.weight_window and worker.exchange_slots if need be), and what is left becomes
    the state servers' RAM tier (state_server.tier.ram_budget_bytes, which must then be
    unset); a run that cannot fit it is refused before it starts. `cargohold plan` prints
    the split. null: no budget (each part as configured)."""

    def __post_init__(self) -> None:
        if self.num_cpus is not None:
            _positive("cluster.num_cpus", self.num_cpus)
        _positive("cluster.startup_timeout_s", self.startup_timeout_s)
        if self.host_memory_bytes is not None:
            _positive("cluster.host_memory_bytes", self.host_memory_bytes)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go (step-<N>/ folders with a manifest.json written last); None
    takes none, and then a failure cannot be recovered from."""
    every_steps: int = 0
    """Take a checkpoint every this many steps (and after the last); 0 only at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a new one lands."""
    resume: str | None = None
    """Start from "latest" (in dir) or from a checkpoint folder; None starts fresh. Keys
    of the checkpoint's config that give its state its meaning (model shape, Adam betas,
    seed and data) must be unchanged; other changed keys are logged as a warning."""
    max_failures: int = 0
    """Actor failures to recover from (restart everything from the run's latest
    checkpoint, or from where it started when none has landed) before the run gives up."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A checkpoint that cannot be written (its folder cannot be created, disk full,
    unwritable): stop the run with the reason (max_failures does not restart it), or log
    it and keep training (earlier checkpoints stay intact either way)."""

    def __post_init__(self) -> None:
        _non_negative("checkpoint.every_steps", self.every_steps)
        _positive("checkpoint.keep_last", self.keep_last)
        _non_negative("checkpoint.max_failures", self.max_failures)
        if (self.every_steps or self.max_failures or self.resume == "latest") and not self.dir:
            raise ConfigError(
                "checkpoint.dir must be set for checkpoint.every_steps, checkpoint.max_failures "
                "or checkpoint.resume=latest"
            )
        if self.dir:
            _check_output_folder("checkpoint.dir", self.dir)
        if self.resume not in (None, "latest") and not Path(self.resume).expanduser().is_dir():
            raise ConfigError(
                f"checkpoint.resume {self.resume!r} is not a folder: name a checkpoint folder, a folder "
                "of checkpoints, or latest (with checkpoint.dir)"
            )


@dataclass(kw_only=True, slots=True)
class SecurityConfig:
    auth_token_env: str | None = "CARGOHOLD_AUTH_TOKEN"
    """Environment variable (read by the launcher) holding the token every state-server
    call must carry; unset or empty makes a random token per run. None turns
    authentication off."""
    tls_cert_file: str | None = None
    """PEM certificate each end presents for mutual TLS (with its key and the CA); its
    subjectAltName must cover the nodes' addresses. All three set, or none."""
    tls_key_file: str | None = None
    tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("tls_cert_file", "tls_key_file", "tls_ca_file") if getattr(self, k)]
        if given and len(given) != 3:
            missing = sorted({"tls_cert_file", "tls_key_file", "tls_ca_file"} - set(given))
            raise ConfigError(f"security.{', security.'.join(missing)} must be set too, for mutual TLS")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    enabled: bool = True
    """Serve Prometheus metrics from every worker and state server."""
    port: int = 0
    """0: each actor's endpoint takes a free port. Otherwise the first of a range:
    state server i serves on port + i, worker rank r on port + num_servers + r, the
    launcher on the port after the last worker's (fixed ports for Kubernetes pod
    monitors and static scrape configs)."""
    file_sd_path: str | None = None
    """Write the run's metrics endpoints here as a Prometheus file_sd target list
    (labels: job, run, role, index), replaced atomically when the run starts."""

    def __post_init__(self) -> None:
        if not (self.port == 0 or 1024 <= self.port <= 65535):
            raise ConfigError(f"metrics.port must be 0 (any free port) or in 1024..65535, got {self.port}")

    def port_for(self, role: str, index: int, config: TrainConfig) -> int:
        """The port an actor's endpoint binds (0 = any free port)."""
        if self.port == 0:
            return 0
        offset = index if role == "state_server" else config.state_server.num_servers + index
        return self.port + offset  # the launcher is "worker" num_workers: the last port


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The root of a run's configuration."""

    run_id: str | None = None
    """Names the run on the state servers; None derives one from the time."""
    steps: int = 50
    seed: int = 0
    """Seeds model initialisation (identical on every worker)."""
    progress: bool = True
    """Show a progress bar with loss and step time."""
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
        """The dtype gradients go to the state servers in: `worker.grad_wire_dtype`, or
        float32 when micro-batches are accumulated, since their sum is kept in fp32 (as
        FSDP2 sums gradients into fp32 parameters' `.grad`) and rounding it to the wire
        dtype would lose what the accumulation added."""
        return "float32" if self.data.micro_batches > 1 else self.worker.grad_wire_dtype

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        if self.export_dir == "":
            raise ConfigError("export_dir must be a folder path or null, got an empty string")
        if self.export_dir is not None:
            _check_output_folder("export_dir", self.export_dir)
        _check_separate_folders(self)
        _check_run_id(self.run_id)
        self.eval.check_format(self.data.format)
        _check_float16(self)
        _check_device_state(self)
        last_port = self.metrics.port + self.state_server.num_servers + self.worker.num_workers
        if self.metrics.port and last_port > 65535:
            raise ConfigError(f"metrics.port {self.metrics.port} leaves no room for every actor (up to {last_port})")


def _positive(key: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a finite number > 0, got {value}")


def _non_negative(key: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a finite number >= 0, got {value}")


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A run id names folders (NVMe tier, shared memory) and Ray actors: one path component."""
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


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
            f"worker.grad_wire_dtype=float16 needs worker.compute_dtype=float16 (got {worker.compute_dtype}): "
            "only gradients computed with a loss scale keep their small values in fp16"
        )


def _check_device_state(config: TrainConfig) -> None:
    """GPU workers keep their share of the optimizer in fp32: the bf16 and 8-bit kinds'
    codecs run on the state servers' CPUs."""
    worker, state_dtype = config.worker, config.optim.state_dtype
    on_gpus = worker.device == "cuda" or (worker.device == "auto" and worker.gpus > 0)
    if on_gpus and worker.optimizer_on_device_fraction and state_dtype != "float32":
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


def _check_output_folder(key: str, path: str) -> None:
    """Refuse a folder that can never be created: it, or a folder above it, is a file."""
    for candidate in (Path(path).expanduser().absolute(), *Path(path).expanduser().absolute().parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise ConfigError(f"{key} {path!r} cannot be a folder: {candidate} is a file")
            return
