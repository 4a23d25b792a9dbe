"""One state server's plan: its range of the flat buffer, where the tier planner puts each
of its partitions, the memory and disk they take, a step's temporaries, its checkpoints,
and the bytes it moves."""

from __future__ import annotations

from dataclasses import dataclass

from cargohold.cluster.plan.itemsize import DTYPE_BYTES, FP32_BYTES
from cargohold.cluster.plan.runtime import SERVER_RUNTIME_BYTES
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.layout import Layout
from cargohold.services.core.state_precision import stored_bytes
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes
from cargohold.services.tiers.partitions import elements_per_partition, partition_align, split_segment
from cargohold.services.tiers.planner import PartitionDemand, TierPlan, plan_tiers
from cargohold.services.tiers.residency import PartitionKey, Residency


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTraffic:
    """Bytes one state server moves per step."""

    push_bytes: int
    """Gradients received (wire dtype) for its range."""
    fetch_bytes: int
    """Weights sent (compute dtype) for its range."""
    nvme_write_bytes: int
    """Every disk partition is written back once per step."""
    nvme_read_bytes: int
    """At most every disk partition is read once per step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPlan:
    """One state server: its range of the flat buffer and where that state lives."""

    index: int
    elements: int
    segments: int
    partitions: int
    partitions_on_nvme: int
    ram_state_bytes: int
    """State (12 B/element) planned in RAM: ``cargohold_state_resident_bytes{tier="ram"}``."""
    nvme_state_bytes: int
    """State planned on NVMe: ``cargohold_state_resident_bytes{tier="nvme"}``."""
    ram_resident_bytes: int
    """Memory the resident partitions occupy (their 4 KiB-aligned file layout) with room
    for the gradients staged for them."""
    staging_bytes: int
    """Staging buffers of the NVMe tier, for states and staged gradients (0 without one)."""
    gradient_bytes: int
    """Gradients of the pushes in flight, as the transport assembles them (upper bound);
    staged ones wait beside their partitions (in ``ram_resident_bytes`` or on disk)."""
    update_temp_bytes: int
    """fp32 copies of the gradient of the partitions being updated at once (upper bound)."""
    weights_bytes: int
    """Updated weights in the compute dtype waiting for their fetch (the server's weight
    buffers: 2 x ``rpc_threads`` segments at most), plus the streamed copies of those being
    fetched (upper bound)."""
    nvme_file_bytes: int
    """Partition files on disk, with the staged gradients' files beside them."""
    nvme_gradient_bytes: int
    """Of those, the staged gradients' files (clipping or the non-finite check on)."""
    nvme_need_bytes: int
    """Files plus room for the writes in flight (what start-up checks against free space)."""
    nvme_bytes_by_path: dict[str, int]
    traffic: ServerTraffic
    checkpoint_bytes: int = 0
    """Payload files one checkpoint holds for this server (0 without ``checkpoint.dir``)."""
    checkpoint_written_bytes: int = 0
    """Of those, bytes written per checkpoint (the rest are the NVMe tier's files,
    hard-linked; copied instead when ``checkpoint.dir`` is on another filesystem)."""
    checkpoint_snapshot_bytes: int = 0
    """RAM a checkpoint copies the state into until written (all-RAM state only): the
    partitions' file layouts, as the RAM tier holds them."""
    runtime_bytes: int = 0
    """The process's runtime (Python, torch, Ray, gRPC): measured, :mod:`.runtime`."""
    registration_bytes: int = 0
    """While it starts: the fp32 initial values of the segments registered at once (one
    per worker, up to ``rpc_threads``), as received."""

    @property
    def ram_bytes(self) -> int:
        """Memory the tiers hold: the part ``state_server.tier.ram_budget_bytes`` limits."""
        return self.ram_resident_bytes + self.staging_bytes

    @property
    def step_bytes(self) -> int:
        """What a step adds to the tiers: transfers in flight, update temporaries, weights
        to fetch, a checkpoint's snapshot."""
        return self.gradient_bytes + self.update_temp_bytes + self.weights_bytes + self.checkpoint_snapshot_bytes

    @property
    def ram_peak_bytes(self) -> int:
        """The runtime and the tiers, plus the larger of a step's additions and start-up's."""
        return self.runtime_bytes + self.ram_bytes + max(self.step_bytes, self.registration_bytes)


def plan_server(config: TrainConfig, layout: Layout, index: int, transport: str) -> ServerPlan:
    """State server ``index`` of ``layout``: its partitions placed by the tier planner as
    ``TieredStorage`` places them, and what it holds and moves with ``transport``."""
    tier = config.state_server.tier
    compute = DTYPE_BYTES[config.worker.compute_dtype]
    wire = DTYPE_BYTES[config.push_dtype]  # what workers push: fp32 when they accumulate micro-batches
    budget = tier.ram_budget_bytes
    kind = config.optim.state_dtype  # how the moments are stored: the files' layout and the bytes
    align = partition_align(kind)
    max_elements = elements_per_partition(tier.partition_size(), align) if budget is not None else None
    run_id = config.run_id or "plan"
    segments = layout.segments_of_server(index)
    spans = {
        s.segment_id: split_segment(s.numel, [(f.segment_start, f.length) for f in s.fragments], max_elements, align)
        for s in segments
    }
    # The demands TieredStorage._replan gives the planner: every partition in its file layout.
    numel = {PartitionKey(run_id, sid, span.index): span.numel for sid, parts in spans.items() for span in parts}
    staging = tier.staging_bytes() if budget is not None else 0
    plan: TierPlan = plan_tiers(
        [
            PartitionDemand(key, FileLayout(n, kind).file_bytes, gradient_bytes=gradient_file_bytes(n, wire))
            for key, n in numel.items()
        ],
        ram_budget_bytes=budget,
        staging_bytes=staging,
        num_paths=max(1, len(tier.nvme_paths)),
    )
    on_disk = [k for k in numel if plan.of(k) is Residency.NVME]
    if config.checkpoint.dir is None:
        checkpoint_bytes = checkpoint_written = snapshot = 0
    else:  # one partition file each: disk ones hard-linked, RAM ones written (from a copy without a budget)
        checkpoint_bytes = sum(FileLayout(n, kind).file_bytes for n in numel.values())
        checkpoint_written = checkpoint_bytes - sum(FileLayout(numel[k], kind).file_bytes for k in on_disk)
        snapshot = checkpoint_bytes if budget is None else 0
    defer = config.optim.max_grad_norm > 0 or config.optim.nonfinite != "ignore"
    by_path: dict[str, int] = {}
    for key in on_disk:
        path = tier.nvme_paths[plan.path_index[key]]
        staged = gradient_file_bytes(numel[key], wire) if defer else 0
        by_path[path] = by_path.get(path, 0) + FileLayout(numel[key], kind).file_bytes + staged
    nvme_state = sum(stored_bytes(kind, numel[k]) for k in on_disk)
    elements = sum(s.numel for s in segments)

    threads = config.state_server.rpc_threads  # requests a server handles at once
    sizes = sorted((s.numel for s in segments), reverse=True)
    busiest = sum(sizes[:threads])
    gradient_files = sum(gradient_file_bytes(numel[k], wire) for k in on_disk)  # start-up reserves their room
    staged_on_disk = gradient_files if defer else 0
    largest_partition = sorted((max(p.numel for p in parts) for parts in spans.values()), reverse=True)
    return ServerPlan(
        index=index,
        elements=elements,
        segments=len(segments),
        partitions=len(numel),
        partitions_on_nvme=len(on_disk),
        ram_state_bytes=sum(stored_bytes(kind, n) for n in numel.values()) - nvme_state,
        nvme_state_bytes=nvme_state,
        ram_resident_bytes=plan.ram_bytes,
        staging_bytes=staging,
        gradient_bytes=busiest * wire,
        update_temp_bytes=sum(largest_partition[:threads]) * FP32_BYTES,
        weights_bytes=(sum(sizes[: 2 * threads]) + (0 if transport == "shared_memory" else busiest)) * compute,
        nvme_file_bytes=plan.nvme_bytes + staged_on_disk,
        nvme_gradient_bytes=staged_on_disk,
        nvme_need_bytes=plan.nvme_bytes + gradient_files + staging if on_disk else 0,
        nvme_bytes_by_path=by_path,
        traffic=ServerTraffic(
            push_bytes=elements * wire,
            fetch_bytes=elements * compute,
            nvme_write_bytes=plan.nvme_bytes + staged_on_disk,
            nvme_read_bytes=plan.nvme_bytes + staged_on_disk,
        ),
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_written_bytes=checkpoint_written,
        checkpoint_snapshot_bytes=snapshot,
        runtime_bytes=SERVER_RUNTIME_BYTES,
        registration_bytes=sum(sizes[: min(threads, layout.num_workers)]) * FP32_BYTES,
    )
