"""The tier planner: which partitions stay in RAM, which file path each uses, in what
order a segment's update streams them, and what that costs per step. Pure functions of
sizes, the RAM budget and measured disk bandwidth; no I/O.

Policy, and why:

* **Residency.** The RAM budget pays first for the staging buffers the NVMe tier streams
  through (``buffer_count`` of them); what is left holds resident partitions. Every
  partition is updated once per step, so each byte on disk costs the same read + write
  whichever partition it is: what residency changes is *when* a segment's update must
  wait. An update stalls only until its first disk partition has arrived, so RAM goes
  to the heads of the segments, round-robin: partition 0 of every segment, then partition 1
  of every segment, and so on while they fit. Each update then starts on RAM while the
  pipeline reads its first disk partitions.
* **Order.** A segment streams its RAM partitions first, then its disk partitions in a
  direction that alternates with the step's parity. The last partitions written in one
  step are still in the staging buffers, so they are the first ones the next step needs:
  they start warm, with no read at all.
* **Paths.** Partition ``i`` of segment ``s`` lives on path ``(s + i) % len(paths)``:
  consecutive partitions of a stream sit on different drives, so reading k+1 and writing
  k-1 go to different devices. The choice never changes, so files never move.
* **Cost.** Drives work in parallel; the step's I/O time is the slowest path's
  ``bytes / read bandwidth + bytes / write bandwidth`` over its disk partitions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cargohold.services.tiers.residency import PartitionKey, Residency


@dataclass(frozen=True, slots=True)
class PartitionDemand:
    """A partition the planner places: its key and the bytes of its state."""

    key: PartitionKey
    state_bytes: int
    gradient_bytes: int = 0
    """Bytes of the gradient staged for it between a push and its commit, which take
    RAM only while the partition is resident (a disk partition's go beside its file)."""

    @property
    def ram_bytes(self) -> int:
        return self.state_bytes + self.gradient_bytes


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Measured sequential bandwidth of one tier path, in bytes per second."""

    read_bytes_per_s: float
    write_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class TierPlan:
    """The planner's decision for every partition of one state server."""

    residency: Mapping[PartitionKey, Residency] = field(default_factory=dict)
    path_index: Mapping[PartitionKey, int] = field(default_factory=dict)
    """Index into the configured NVMe paths of each partition's file."""
    ram_budget_bytes: int | None = None
    staging_bytes: int = 0
    """Part of the budget set aside for the NVMe tier's staging buffers."""
    ram_bytes: int = 0
    """Bytes planned resident in RAM: the partitions' states and the gradients staged for them."""
    nvme_bytes: int = 0
    """State bytes planned on disk."""
    predicted_io_seconds: float = 0.0
    """Disk time of one step (read + write each disk partition once); 0 without disk."""

    def of(self, key: PartitionKey) -> Residency:
        return self.residency.get(key, Residency.RAM)

    def count(self, residency: Residency) -> int:
        return sum(1 for r in self.residency.values() if r is residency)


def plan_tiers(
    partitions: Iterable[PartitionDemand],
    *,
    ram_budget_bytes: int | None,
    staging_bytes: int,
    bandwidths: Sequence[Bandwidth] = (),
    num_paths: int = 1,
    capacities: Sequence[tuple[Residency, int | None]] = (),
) -> TierPlan:
    """Place every partition; ``ram_budget_bytes=None`` keeps everything in RAM.

    ``capacities``: the storage's tiers, fastest first, and what each may hold (None: no
    limit, the last one); by default RAM with the budget less the staging buffers, then
    NVMe. ``bandwidths`` (one per path, may be empty while unmeasured) only feed the cost
    estimate. Raises ValueError when the budget cannot even hold the staging buffers.
    """
    demands = sorted(partitions, key=lambda d: d.key)
    if ram_budget_bytes is None:
        return TierPlan(
            residency={d.key: Residency.RAM for d in demands},
            ram_bytes=sum(d.ram_bytes for d in demands),
        )
    if num_paths < 1:
        raise ValueError("a RAM budget needs at least one NVMe path")
    capacity = ram_budget_bytes - staging_bytes
    if capacity < 0:
        raise ValueError(
            f"RAM budget {ram_budget_bytes} bytes is smaller than the {staging_bytes} bytes of staging buffers"
        )
    tiers = list(capacities) or [(Residency.RAM, capacity), (Residency.NVME, None)]
    residency = _fill(demands, tiers)
    ram_bytes = sum(d.ram_bytes for d in demands if residency[d.key] is Residency.RAM)
    path_index = {d.key: path_of(d.key, num_paths) for d in demands}
    on_disk = [d for d in demands if residency[d.key] is Residency.NVME]
    return TierPlan(
        residency=residency,
        path_index=path_index,
        ram_budget_bytes=ram_budget_bytes,
        staging_bytes=staging_bytes,
        ram_bytes=ram_bytes,
        nvme_bytes=sum(d.state_bytes for d in on_disk),
        predicted_io_seconds=predict_io_seconds(on_disk, path_index, bandwidths),
    )


def _fill(
    demands: Sequence[PartitionDemand], tiers: Sequence[tuple[Residency, int | None]]
) -> dict[PartitionKey, Residency]:
    """The heads of the segments first (partition 0 of every segment, then 1, ...), each
    into the fastest tier with room left for it; the last tier takes the rest."""
    left = [capacity for _, capacity in tiers]
    residency: dict[PartitionKey, Residency] = {}
    for demand in sorted(demands, key=lambda d: (d.key.index, d.key.run_id, d.key.segment_id)):
        for n, (tier, _) in enumerate(tiers):
            room = left[n]
            if room is None or n == len(tiers) - 1 or demand.ram_bytes <= room:
                residency[demand.key] = tier
                left[n] = None if room is None else room - demand.ram_bytes
                break
    return residency


def path_of(key: PartitionKey, num_paths: int) -> int:
    """Round-robin over the paths along a segment, offset by the segment id."""
    return (key.segment_id + key.index) % num_paths


def predict_io_seconds(
    on_disk: Iterable[PartitionDemand],
    path_index: Mapping[PartitionKey, int],
    bandwidths: Sequence[Bandwidth],
) -> float:
    """Seconds of disk time per step: the slowest path reads and writes all its bytes."""
    if not bandwidths:
        return 0.0
    per_path: dict[int, int] = {}
    for demand in on_disk:
        per_path[path_index[demand.key]] = per_path.get(path_index[demand.key], 0) + demand.state_bytes
    return max(
        (
            nbytes / bandwidths[p].read_bytes_per_s + nbytes / bandwidths[p].write_bytes_per_s
            for p, nbytes in per_path.items()
        ),
        default=0.0,
    )


def stream_order(partitions: Sequence[tuple[int, Residency]], update: int) -> tuple[int, ...]:
    """The order a segment's update number ``update`` visits its partitions (by index).

    RAM partitions first, ascending; then each slower tier's (in the order ``Residency``
    names them) ascending on odd updates, descending on even ones, so each update begins
    with the partitions the previous one wrote last.
    """
    order: list[int] = []
    for tier in Residency:
        indices = sorted((i for i, r in partitions if r is tier), reverse=tier is not Residency.RAM and update % 2 == 0)
        order += indices
    return tuple(order)
