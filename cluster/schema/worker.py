"""``worker.*``: the training workers, one Ray actor per accelerator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cargohold.cluster.schema.checks import check_output_folder, non_negative, positive
from cargohold.cluster.schema.tuning import tuning
from cargohold.services.core.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]

HostAllocatorSetting = Literal["auto", "mimalloc", "glibc"]
"""``tuning.worker.host_allocator`` (`services/worker/host_allocator.py`)."""


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    num_workers: int = 2
    """Data-parallel workers, one per accelerator (CPU processes when there is none)."""
    compute_dtype: DType = "float32"
    """Dtype of the weights the worker holds and computes in. float16 (GPUs without bf16:
    T4, V100) scales the loss dynamically (`tuning.optim.loss_scale`); it needs
    `optim.nonfinite: skip`, since the steps whose scaled gradients overflow are skipped."""
    grad_wire_dtype: DType = tuning("float32")
    """Dtype gradients are reduced among workers and pushed to state servers in: bfloat16
    halves the bytes each step moves, against fp32's bitwise contract with FSDP2's fp32
    reduction; float16 only with `worker.compute_dtype: float16` (the gradients then carry
    the loss scale)."""
    reshard_after_forward: bool = True
    """Free each block's gathered weights after its forward and gather them again for
    backward (ZeRO-3); false keeps them from forward to backward (ZeRO-2-like: faster,
    but every block's full weights stay resident during the step)."""
    kept_gathered_units: int = tuning(1)
    """With `reshard_after_forward`: the last this many units stay gathered from their
    forward to their backward, so their backward skips the all-gather. The last unit's
    backward comes right after its forward (FSDP2 would gather it again at once), so 1
    costs no memory; each one more holds one more unit gathered through the middle of
    the step (`cargohold plan` counts them). DeepSpeed's ZeRO-3 keeps parameters the same
    way (`stage3_max_reuse_distance`, in elements)."""
    shared_memory_collectives: Literal["auto", "off"] = tuning("auto")
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
    weight_window: int = tuning(3)
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
    delayed_update_after_steps: int = tuning(0)
    """With delayed_update, train this many data steps normally first (ZeRO-Offload's
    warm-up): stale gradients hurt most early, while the loss falls fast."""
    exchange_slots: int = tuning(3)
    """Host buffers of one unit's part of the worker's range (its gradient out, its
    updated weights back) that transfers to the state servers go through. More slots let
    more units' transfers overlap backward; each costs the largest unit's local elements
    x (wire + compute dtype) bytes. Backward waits when all are in use."""
    shared_memory: Literal["auto", "off"] = tuning("auto")
    """auto: exchange gradients and weights with state servers on the same node through
    shared memory (a sealed memfd the server maps) instead of gRPC streams; a GPU worker
    page-locks it, so its copies to and from the device are DMA; off: always stream over
    gRPC."""
    cpus: float = 1.0
    """Ray CPUs reserved per worker; its torch runs this many intra-op threads (at least 1)."""
    gpus: float = 0.0
    """Ray GPUs reserved per worker; it also says where the workers compute: above 0 on
    CUDA with NCCL between them (set 1 on GPU nodes), 0 on the CPU with gloo."""
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
    host_allocator: HostAllocatorSetting = tuning("auto")
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

    @property
    def on_gpus(self) -> bool:
        """The workers compute on CUDA (NCCL between them): they reserve GPUs."""
        return self.gpus > 0

    @property
    def torch_threads(self) -> int:
        """Intra-op threads of each worker's torch: the CPUs Ray reserves for it."""
        return max(1, int(self.cpus))

    def __post_init__(self) -> None:
        positive("worker.num_workers", self.num_workers)
        positive("tuning.worker.exchange_slots", self.exchange_slots)
        if self.weight_window < 2:
            raise ConfigError(f"tuning.worker.weight_window must be an integer >= 2, got {self.weight_window}")
        if self.weights_nvme_path == "":
            raise ConfigError("worker.weights_nvme_path must name a folder or be null, got an empty string")
        if self.weights_nvme_path is not None:
            check_output_folder("worker.weights_nvme_path", self.weights_nvme_path)
        non_negative("tuning.worker.delayed_update_after_steps", self.delayed_update_after_steps)
        non_negative("worker.max_unit_params", self.max_unit_params)
        non_negative("tuning.worker.kept_gathered_units", self.kept_gathered_units)
        non_negative("worker.cpus", self.cpus)
        non_negative("worker.gpus", self.gpus)
        if not 0.0 <= self.optimizer_on_device_fraction <= 1.0:
            raise ConfigError(
                f"worker.optimizer_on_device_fraction must be in [0, 1], got {self.optimizer_on_device_fraction}"
            )
