"""The plan as a table in human units: each worker, each state server, the bytes per step
and per checkpoint, and the verdict per resource."""

from __future__ import annotations

from collections.abc import Callable

from cargohold.cluster.plan.budget import HostBudget
from cargohold.cluster.plan.run import RunPlan
from cargohold.cluster.plan.runtime import RAY_HEAD_DAEMONS_BYTES, RAY_IDLE_WORKER_BYTES, RAY_NODE_DAEMONS_BYTES
from cargohold.cluster.plan.server import ServerPlan
from cargohold.cluster.plan.worker import WorkerPlan
from cargohold.cluster.sizes import format_bytes

_LABEL = 33
"""Width of the row names in :func:`render`."""


def render(plan: RunPlan) -> str:
    """The plan as a table in human units: its sections, a blank line between them."""
    sections = [
        _summary(plan),
        _worker_section(plan),
        _server_section(plan),
        *([_budget_lines(plan.host_budget)] if plan.host_budget is not None else []),
        _per_step(plan),
        *([_per_checkpoint(plan)] if any(s.checkpoint_bytes for s in plan.servers) else []),
        _verdict(plan),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections)


def _summary(plan: RunPlan) -> list[str]:
    """What is planned: the model's size, the workers, the servers and the dtypes."""
    w = plan.worker
    return [
        f"cargohold plan: {plan.parameters:,} parameters ({plan.flat_elements:,} in the flat buffer), "
        f"{plan.num_workers} worker{'s' * (plan.num_workers != 1)} on {w.device}, "
        f"{plan.num_servers} state server{'s' * (plan.num_servers != 1)}",
        f"  weights in {plan.compute_dtype}, gradients on the wire in {plan.grad_wire_dtype}, "
        f"push/fetch over {plan.transport.replace('_', ' ')}",
    ]


def _worker_section(plan: RunPlan) -> list[str]:
    """Each worker: its units, its memory row by row, and how far the tuning could go."""
    w = plan.worker
    lines = [
        f"Each worker (rank 0, the largest shards; a {w.range_elements:,}-element range of the flat buffer)",
        _units_line(w),
        *(f"  {name:<{_LABEL}} {format_bytes(n):>10}  {where}" for name, n, where in _worker_rows(plan)),
    ]
    if plan.device_fraction_fit is not None:
        lines.append(
            f"  worker.optimizer_on_device_fraction: up to {plan.device_fraction_fit:g} fits the GPU memory the "
            f"step leaves (set: {plan.device_fraction:g}; {w.device_state_per_element:.3g} B per element)"
        )
    if plan.kept_gathered_fit is not None:
        lines.append(
            f"  tuning.worker.kept_gathered_units: up to {plan.kept_gathered_fit} fit the GPU memory (set: "
            f"{plan.kept_gathered_units}; each kept unit skips its backward all-gather)"
        )
    return lines


def _units_line(w: WorkerPlan) -> str:
    """How the worker's FSDP2 units are cut, gathered and stored."""
    return (
        f"  FSDP2 units: root + {w.units} {_others(w.units, w.max_unit_params)}"
        + (
            f" (at most {w.max_unit_params:,} parameters where the model allows; largest {w.largest_unit:,})"
            if w.max_unit_params
            else ""
        )
        + (_resharding(w.kept_gathered_units) if w.reshard_after_forward else ", gathered from forward to backward")
        + f"; activation checkpointing {w.activation_checkpointing}"
        + ("; weight shards offloaded to host RAM" if w.offload and not w.nvme_weight_bytes else "")
        + (
            f"; their weights on NVMe ({format_bytes(w.nvme_weight_bytes)} of files), "
            f"{w.weight_window} units in host RAM at once"
            if w.nvme_weight_bytes
            else ""
        )
    )


def _worker_rows(plan: RunPlan) -> list[tuple[str, int, str]]:
    """The worker's memory as (what, bytes, where) rows: the compute device's, then host RAM's."""
    w = plan.worker
    on = "GPU" if w.device == "cuda" else "host RAM"
    host = "pinned host RAM" if w.device == "cuda" else "host RAM"
    in_flight = max(2, w.kept_gathered_units + 1) if w.reshard_after_forward else w.units
    gathered = f"root + {in_flight} {_others(in_flight, w.max_unit_params)}"
    return [
        *([] if w.offload else [("weight shards", w.buffers["weights"], on)]),
        (f"{gathered} gathered (bound)", w.gathered_bytes, on),
        ("gradients in backward (bound)", w.gradient_bytes, on),
        ("per-step temporaries (bound)", w.transient_bytes, on),
        ("activations (estimate)", w.activation_bytes, on),
        *(
            [(f"optimizer, {plan.device_fraction:g} of the range", w.device_state_bytes + w.device_update_bytes, on)]
            if w.device_state_bytes
            else []
        ),
        ("= compute device total", w.device_peak_bytes, on),
        *([("weight shards (offloaded)", w.buffers["weights"], host)] if w.offload else []),
        ("exchange buffers", w.buffers["exchange"], f"{host}, shared" if w.shared_memory_bytes else host),
        *(
            [("collectives (shared memory)", w.buffers["collectives"], "host RAM, shared")]
            if "collectives" in w.buffers
            else []
        ),
        *([("offload: gradient copies", w.host_transient_bytes, "host RAM")] if w.offload else []),
        ("corpus", w.corpus_bytes, "host RAM"),
        *(
            [("allocator: freed, kept (mimalloc)", w.allocator_kept_bytes, "host RAM")]
            if w.allocator_kept_bytes
            else []
        ),
        ("runtime (Python, torch, Ray)", w.runtime_bytes, "host RAM"),
        ("while training", w.host_bytes, "host RAM"),
        ("while starting", w.startup_host_bytes, "host RAM"),
        ("= host peak", w.host_peak_bytes, "host RAM"),
    ]


_SERVER_ROWS: tuple[tuple[str, Callable[[ServerPlan], int]], ...] = (
    ("state on NVMe", lambda s: s.nvme_state_bytes),
    ("RAM: resident partitions", lambda s: s.ram_resident_bytes),
    ("RAM: staging buffers", lambda s: s.staging_bytes),
    ("RAM: step gradients", lambda s: s.gradient_bytes),
    ("RAM: update temporaries", lambda s: s.update_temp_bytes),
    ("RAM: weights to fetch", lambda s: s.weights_bytes),
    ("RAM: checkpoint snapshot", lambda s: s.checkpoint_snapshot_bytes),
    ("RAM: registration (start-up)", lambda s: s.registration_bytes),
    ("RAM: runtime", lambda s: s.runtime_bytes),
    ("= RAM peak", lambda s: s.ram_peak_bytes),
    ("NVMe files", lambda s: s.nvme_file_bytes),
    ("NVMe + writes in flight", lambda s: s.nvme_need_bytes),
)
"""The state servers' rows after the first (the state in RAM, whose name says its bytes per
parameter), one column per server."""


def _server_section(plan: RunPlan) -> list[str]:
    """Each state server, a column apiece."""
    names = [f"server {s.index}" for s in plan.servers]
    first = plan.servers[0] if plan.servers else None
    per_param = (first.ram_state_bytes + first.nvme_state_bytes) / first.elements if first and first.elements else 12
    rows: list[tuple[str, Callable[[ServerPlan], int]]] = [
        (f"state in RAM ({per_param:.3g} B/param)", lambda s: s.ram_state_bytes),
        *_SERVER_ROWS,
    ]
    return [
        f"{'Each state server':<{_LABEL + 2}}" + "".join(f"{n:>12}" for n in names),
        *(f"  {name:<{_LABEL}}" + "".join(f"{format_bytes(get(s)):>12}" for s in plan.servers) for name, get in rows),
        f"  {'partitions (on NVMe)':<{_LABEL}}"
        + "".join(f"{f'{s.partitions} ({s.partitions_on_nvme})':>12}" for s in plan.servers),
    ]


def _per_step(plan: RunPlan) -> list[str]:
    """The bytes each worker and each server moves per step."""
    b, t = format_bytes, plan.worker.traffic
    return [
        "Per step",
        f"  each worker: reduce-scatter {b(t.reduce_scatter_bytes)}, all-gather {b(t.all_gather_bytes)} "
        f"(ring), push {b(t.push_bytes)}, fetch {b(t.fetch_bytes)}"
        + (
            f", weight files: NVMe reads {b(t.weight_read_bytes)}, writes {b(t.weight_write_bytes)}"
            if t.weight_read_bytes
            else ""
        ),
        *(
            f"  server {s.index}: receives {b(s.traffic.push_bytes)}, sends {b(s.traffic.fetch_bytes)}"
            + (
                f", NVMe writes {b(s.traffic.nvme_write_bytes)} and reads <= {b(s.traffic.nvme_read_bytes)}"
                if s.traffic.nvme_write_bytes
                else ""
            )
            for s in plan.servers
        ),
    ]


def _per_checkpoint(plan: RunPlan) -> list[str]:
    """A checkpoint's files, and what ``checkpoint.dir`` holds while one is saved."""
    b = format_bytes
    total = sum(s.checkpoint_bytes for s in plan.servers)
    written = sum(s.checkpoint_written_bytes for s in plan.servers)
    kept = plan.checkpoint_keep_last
    return [
        "Per checkpoint",
        f"  files {b(total)}: written {b(written)}, hard-linked from the NVMe tier {b(total - written)}",
        f"  checkpoint.dir holds up to {kept + 1} while one is saved: {b((kept + 1) * total)}"
        + (
            "; on the tier's filesystem the linked files stop being shared once the tier writes newer versions"
            if written < total
            else ""
        ),
    ]


def _verdict(plan: RunPlan) -> list[str]:
    """Each check's verdict, the plan's, and its notes."""
    lines = ["Fits"]
    for c in plan.checks:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "unchecked"}[c.fits]
        need = f"{c.need}" if c.unit == "count" else format_bytes(c.need)
        have = "?" if c.available is None else (f"{c.available}" if c.unit == "count" else format_bytes(c.available))
        lines.append(f"  {verdict:<13} {c.resource}: {need} of {have} ({c.reason})")
    return [*lines, "", "=> fits" if plan.fits else "=> does not fit", *(f"note: {n}" for n in plan.notes)]


def _resharding(kept: int) -> str:
    """How units are resharded after forward, ``kept`` of the last ones excepted."""
    return ", resharded after forward" + {0: "", 1: " but the last one"}.get(kept, f" but the last {kept}")


def _others(count: int, max_unit_params: int) -> str:
    """What the units besides the root are called: blocks, or units below a block."""
    word = "unit" if max_unit_params else "block"
    return word + "s" * (count != 1)


def _budget_lines(split: HostBudget) -> list[str]:
    """How ``cluster.host_memory_bytes`` is split (the plan above is of that split)."""
    b = format_bytes
    rows = [
        ("driver", split.driver_bytes, "its runtime"),
        (
            f"{split.num_workers} x worker",
            split.num_workers * split.worker_bytes,
            f"{b(split.worker_bytes)} each: weight window {split.weight_window}, exchange slots {split.exchange_slots}",
        ),
        (
            f"{split.num_servers} x state server",
            split.num_servers * split.server_bytes,
            f"{b(split.server_bytes)} each: runtime, a step's transfers (or start-up's registration); "
            f"{split.rpc_threads} handler threads",
        ),
        (
            f"{split.num_servers} x RAM tier",
            split.num_servers * split.tier_bytes,
            f"{b(split.tier_bytes)} each: what is left (state_server.tier.ram_budget_bytes)"
            + (f", partitions of {b(split.partition_bytes)}" if split.partition_bytes else ""),
        ),
        ("= need", split.need_bytes, f"of {b(split.budget_bytes)}"),
    ]
    return [
        f"Host budget (cluster.host_memory_bytes {b(split.budget_bytes)}, cargohold's processes of the run)",
        *(f"  {name:<{_LABEL}} {b(n):>10}  {note}" for name, n, note in rows),
        "  counts: the driver, the workers and the state servers, each with its runtime",
        f"  leaves out: Ray's own processes, about {b(RAY_HEAD_DAEMONS_BYTES)} on the head node (GCS, dashboard, "
        "raylet, agents)",
        f"    and {b(RAY_NODE_DAEMONS_BYTES)} on each other node (raylet, agents), plus {b(RAY_IDLE_WORKER_BYTES)} "
        "per idle Ray worker,",
        "    measured (PSS) on an idle node with Ray 2.60 (docs/operations.md); leave them room outside the budget",
    ]
