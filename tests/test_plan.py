"""`cargohold plan`: the arithmetic on small configs. A worker's buffers, units in flight,
gradients, temporaries and activations follow the layout and the worker settings; a
state server's state, memory, files and checkpoints follow the tier planner. The
cluster description and the checks are in test_plan_cluster.py, the command and the
shipped examples in test_plan_cli.py, the plan against a real run in test_plan_run.py.

The device-side figures (units in flight, gradients in backward, temporaries,
activations) are bounds and estimates; here only their arithmetic is tested.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cargohold.cluster.plan.description import ClusterDescription
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.plan.worker import MIMALLOC_KEPT_SHARE
from cargohold.cluster.schema.server import TierConfig
from cargohold.cluster.sections import config_layout
from cargohold.services.core.layout import Layout
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes
from cargohold.services.tiers.partitions import STATE_BYTES_PER_ELEMENT
from cargohold.services.tiers.source import tensor_source
from cargohold.services.tiers.storage import TieredStorage
from tests.plans import nvme_tier
from tests.reference import tiny_config


def _layout(config) -> Layout:
    return config_layout(config)[2]


def _units(layout: Layout) -> list[tuple[int, int]]:
    """(parameter elements, padded chunk per worker) of each FSDP2 unit, root first."""
    places = [layout.unit_params(u.index) for u in layout.units]
    return [(sum(s.numel for s in unit), sum(s.padded_numel for s in unit)) for unit in places]


def _exchange(layout: Layout, bytes_per_element: int, slots: int = 3) -> int:
    """Bytes of ``slots`` exchange slots of the largest unit (rounded up to 64 elements)."""
    largest = max(unit.stop - unit.start for unit in layout.units)
    return slots * (-(-largest // 64) * 64) * bytes_per_element


# --- a worker ------------------------------------------------------------------------------
def test_the_collectives_region_is_counted_only_where_it_is_made() -> None:
    """Host memory while training counts the region; gloo's collectives (off) and a lone
    worker have none."""
    shared = plan_run(tiny_config()).worker
    gloo = plan_run(tiny_config(worker__shared_memory_collectives="off")).worker
    assert shared.buffers["collectives"] > 0 and "collectives" not in gloo.buffers
    assert shared.host_bytes - gloo.host_bytes == shared.buffers["collectives"]
    assert shared.startup_host_bytes - gloo.startup_host_bytes == shared.buffers["collectives"]
    assert "collectives (shared memory)" in render(plan_run(tiny_config()))


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_worker_buffers_follow_the_layout(num_workers: int) -> None:
    config = tiny_config(worker__num_workers=num_workers)
    plan, layout = plan_run(config), _layout(config)
    assert plan.flat_elements == layout.total == num_workers * layout.worker_size
    # Rank 0's FSDP2 shards (it holds the most) and its exchange buffers, fp32 both ways.
    shards = sum(place.local_numel(0) for place in layout.params)
    assert shards >= max(sum(place.local_numel(r) for place in layout.params) for r in range(num_workers))
    # CPU workers on one host also hold a region for FSDP2's collectives: a page of
    # semaphores for the barrier, then two halves that each hold the largest unit's
    # gathered weights (every worker's padded chunks), in pages.
    collectives = 4096 + 2 * -(-max(chunk for _, chunk in _units(layout)) * num_workers * 4 // 4096) * 4096
    shared = {"collectives": collectives} if num_workers > 1 else {}
    assert plan.worker.buffers == {"weights": 4 * shards, "exchange": _exchange(layout, 8), **shared}
    assert plan.worker.range_elements == layout.worker_size and plan.worker.units == 2
    traffic = plan.worker.traffic
    assert traffic.push_bytes == traffic.fetch_bytes == 4 * layout.worker_size
    chunks = [chunk for _, chunk in _units(layout)]
    assert traffic.reduce_scatter_bytes == (num_workers - 1) * sum(chunks) * 4
    # Every unit gathered in forward, the first block again in backward (the root and the
    # last block, kept by default, stay).
    assert traffic.all_gather_bytes == (num_workers - 1) * (sum(chunks) + chunks[1]) * 4
    # Every element is pushed by exactly one worker to exactly one server.
    assert sum(s.traffic.push_bytes for s in plan.servers) == num_workers * traffic.push_bytes == 4 * layout.total


def test_the_device_holds_the_units_fsdp2_gathers() -> None:
    """Root + the block computed + the one prefetched + the all-gather buffer; the root's
    gradients plus a block's with FSDP2's reduce-scatter input and output."""
    config = tiny_config(model__n_layer=4, worker__num_workers=2)
    plan, layout = plan_run(config), _layout(config)
    (root, root_chunk), *blocks = _units(layout)
    block, chunk = blocks[0]
    assert all(b == (block, chunk) for b in blocks) and root != block
    w = plan.worker
    assert w.gathered_bytes == 4 * (root + 2 * block + 2 * max(root_chunk, chunk))
    assert w.gradient_bytes == 4 * root + max(4 * block + 3 * 4 * chunk, 3 * 4 * root_chunk)
    assert w.transient_bytes == 8 * max(root_chunk, chunk)  # the fp64 copy for the norm; same dtypes
    assert w.device_peak_bytes == (
        w.buffers["weights"] + w.gathered_bytes + w.gradient_bytes + w.transient_bytes + w.activation_bytes
    )
    alone = plan_run(tiny_config(model__n_layer=4, worker__num_workers=1)).worker
    assert alone.gathered_bytes == 4 * (root + 2 * block)  # nothing to gather from others: no buffer
    assert alone.traffic.reduce_scatter_bytes == alone.traffic.all_gather_bytes == 0


def test_without_resharding_every_block_stays_gathered() -> None:
    config = tiny_config(model__n_layer=4, worker__kept_gathered_units=0)
    resharded, kept = plan_run(config), plan_run(tiny_config(model__n_layer=4, worker__reshard_after_forward=False))
    block = _units(_layout(config))[1][0]
    assert kept.worker.gathered_bytes - resharded.worker.gathered_bytes == 2 * block * 4  # 4 blocks, not 2
    chunks = [chunk for _, chunk in _units(_layout(config))]
    assert resharded.worker.traffic.all_gather_bytes - kept.worker.traffic.all_gather_bytes == sum(chunks[1:]) * 4
    assert "root + 4 blocks gathered" in render(kept) and "root + 2 blocks gathered" in render(resharded)


def test_the_last_blocks_kept_gathered_skip_their_backward_gather() -> None:
    plans = {k: plan_run(tiny_config(model__n_layer=4, worker__kept_gathered_units=k)) for k in (0, 1, 3)}
    units = _units(_layout(tiny_config(model__n_layer=4)))
    block, chunks = units[1][0], [chunk for _, chunk in units]
    strict, last, three = (plans[k].worker for k in (0, 1, 3))
    assert last.gathered_bytes == strict.gathered_bytes  # the last block is needed again at once
    assert three.gathered_bytes - strict.gathered_bytes == 2 * block * 4  # three kept and one prefetched
    assert strict.traffic.all_gather_bytes - last.traffic.all_gather_bytes == chunks[4] * 4  # W - 1 = 1
    assert strict.traffic.all_gather_bytes - three.traffic.all_gather_bytes == sum(chunks[2:]) * 4
    assert "resharded after forward but the last one;" in render(plans[1])
    assert "resharded after forward but the last 3;" in render(plans[3]) and "root + 4 blocks" in render(plans[3])
    assert "resharded after forward;" in render(plans[0]) and "root + 2 blocks" in render(plans[0])


def test_the_plan_says_how_many_units_the_gpu_could_keep_gathered() -> None:
    def gpu_plan(kept: int, memory: int):
        config = tiny_config(model__n_layer=8, worker__gpus=1, worker__kept_gathered_units=kept)
        return plan_run(config, ClusterDescription(device_memory_bytes=memory))

    peaks = [gpu_plan(kept, 1 << 40).worker.device_peak_bytes for kept in range(9)]
    assert peaks[0] == peaks[1] < peaks[2] < peaks[3] < peaks[8]
    assert gpu_plan(1, peaks[3]).kept_gathered_fit == 3
    assert gpu_plan(1, peaks[3] - 1).kept_gathered_fit == 2
    assert gpu_plan(1, 1 << 40).kept_gathered_fit == 8  # every block
    assert gpu_plan(1, peaks[0] - 1).kept_gathered_fit == 0
    assert "tuning.worker.kept_gathered_units: up to 3 fit the GPU memory (set: 1;" in render(gpu_plan(1, peaks[3]))
    assert plan_run(tiny_config(model__n_layer=8)).kept_gathered_fit is None  # a CPU worker


def test_more_workers_shrink_the_shards_not_the_units() -> None:
    configs = {w: tiny_config(worker__num_workers=w, model__n_embd=128) for w in (1, 2, 4)}
    plans = {w: plan_run(c).worker for w, c in configs.items()}
    weights = {w: p.buffers["weights"] for w, p in plans.items()}
    exchange = {w: p.buffers["exchange"] for w, p in plans.items()}
    assert weights[1] > weights[2] > weights[4] and exchange[1] > exchange[2] > exchange[4]
    # 1/W of every parameter, rank 0 rounding its rows up: at most one row per parameter more.
    rows = sum(place.row_numel for place in _layout(configs[4]).params)
    assert weights[1] <= 4 * weights[4] <= weights[1] + 4 * 4 * rows
    buffer = {w: w * max(chunk for _, chunk in _units(_layout(c))) * 4 if w > 1 else 0 for w, c in configs.items()}
    unsharded = {w: p.gathered_bytes - buffer[w] for w, p in plans.items()}
    assert unsharded[1] == unsharded[2] == unsharded[4]  # whole units, whatever the number of workers


def test_bf16_halves_fetch_bytes_and_weights() -> None:
    fp32 = plan_run(tiny_config())
    bf16 = plan_run(tiny_config(worker__compute_dtype="bfloat16"))
    wire16 = plan_run(tiny_config(worker__compute_dtype="bfloat16", worker__grad_wire_dtype="bfloat16"))
    assert bf16.worker.traffic.fetch_bytes * 2 == fp32.worker.traffic.fetch_bytes
    assert bf16.worker.traffic.push_bytes == fp32.worker.traffic.push_bytes  # gradients still fp32 on the wire
    assert bf16.worker.buffers["weights"] * 2 == fp32.worker.buffers["weights"]
    assert bf16.worker.gathered_bytes * 2 == fp32.worker.gathered_bytes
    assert [s.traffic.fetch_bytes * 2 for s in bf16.servers] == [s.traffic.fetch_bytes for s in fp32.servers]
    assert wire16.worker.traffic.push_bytes * 2 == fp32.worker.traffic.push_bytes
    assert wire16.worker.traffic.reduce_scatter_bytes * 2 == fp32.worker.traffic.reduce_scatter_bytes
    assert wire16.worker.traffic.all_gather_bytes * 2 == fp32.worker.traffic.all_gather_bytes
    assert wire16.worker.buffers["exchange"] * 2 == fp32.worker.buffers["exchange"]
    # The state servers keep fp32 state whatever the workers compute in.
    assert [s.ram_state_bytes for s in bf16.servers] == [s.ram_state_bytes for s in fp32.servers]


def test_the_delayed_update_holds_the_weights_of_the_whole_range() -> None:
    """Its weights arrive during the next step and wait for its backward to end."""
    plain = plan_run(tiny_config()).worker
    delayed = plan_run(tiny_config(worker__delayed_update=True)).worker
    assert delayed.buffers["exchange"] - plain.buffers["exchange"] == 4 * plain.range_elements
    assert delayed.buffers["weights"] == plain.buffers["weights"]
    assert delayed.device_peak_bytes == plain.device_peak_bytes


def test_exchange_slots_are_the_size_of_the_largest_unit() -> None:
    config = tiny_config(model__n_layer=4, worker__exchange_slots=5)
    layout = _layout(config)
    largest = max(unit.stop - unit.start for unit in layout.units)
    assert largest < layout.worker_size / 2  # a slot is far smaller than the worker's range
    assert plan_run(config).worker.buffers["exchange"] == 5 * (-(-largest // 64) * 64) * 8


def test_a_gpu_worker_pins_its_exchange_buffers_shared_with_its_server() -> None:
    config = tiny_config(worker__gpus=1, worker__compute_dtype="bfloat16")
    plan = plan_run(config, ClusterDescription(device_memory_bytes=1 << 30))
    w = plan.worker
    assert w.device == "cuda" and plan.transport == "shared_memory"
    assert w.buffers["exchange"] == _exchange(_layout(config), 4 + 2) == w.pinned_bytes == w.shared_memory_bytes
    unshared = plan_run(tiny_config(worker__gpus=1, worker__shared_memory="off"))
    assert unshared.transport == "grpc" and unshared.worker.shared_memory_bytes == 0
    assert unshared.worker.pinned_bytes == unshared.worker.buffers["exchange"]
    assert w.device_bytes == w.buffers["weights"]
    assert w.host_bytes == w.runtime_bytes + w.buffers["exchange"] + w.corpus_bytes
    on_cpu = plan_run(tiny_config(worker__compute_dtype="bfloat16"))  # worker.gpus 0: CPU workers
    assert on_cpu.worker.device == "cpu" and on_cpu.worker.pinned_bytes == 0
    assert on_cpu.transport == "shared_memory" and on_cpu.worker.shared_memory_bytes == _exchange(_layout(config), 6)
    assert on_cpu.worker.host_bytes == (
        on_cpu.worker.runtime_bytes
        + on_cpu.worker.device_peak_bytes
        + on_cpu.worker.buffers["exchange"]
        + on_cpu.worker.buffers["collectives"]
        + on_cpu.worker.corpus_bytes
        + on_cpu.worker.allocator_kept_bytes
    )
    assert w.allocator_kept_bytes == 0  # a GPU's step buffers are the CUDA caching allocator's


def test_a_cpu_worker_on_mimalloc_counts_the_freed_memory_it_keeps() -> None:
    kept = plan_run(tiny_config(worker__host_allocator="mimalloc")).worker
    returned = plan_run(tiny_config(worker__host_allocator="glibc")).worker
    step_buffers = kept.gathered_bytes + kept.gradient_bytes + kept.transient_bytes + kept.activation_bytes
    assert kept.allocator_kept_bytes == round(MIMALLOC_KEPT_SHARE * step_buffers) > 0
    assert returned.allocator_kept_bytes == 0
    assert kept.host_bytes == returned.host_bytes + kept.allocator_kept_bytes
    assert "allocator: freed, kept (mimalloc)" in render(plan_run(tiny_config(worker__host_allocator="mimalloc")))
    assert "allocator: freed, kept" not in render(plan_run(tiny_config(worker__host_allocator="glibc")))
    # "auto" runs glibc under one host budget, whose split counts the workers as glibc leaves them.
    budgeted = plan_run(tiny_config(cluster__host_memory_bytes=64 << 30)).worker
    assert budgeted.allocator_kept_bytes == 0 and plan_run(tiny_config()).worker.allocator_kept_bytes > 0


def test_offload_moves_the_weights_from_the_device_to_pinned_host_memory() -> None:
    base = {"worker__gpus": 1, "worker__compute_dtype": "bfloat16", "model__n_layer": 4}
    plain = plan_run(tiny_config(**base)).worker
    offload = plan_run(tiny_config(**base, worker__offload_params=True)).worker
    chunk = max(chunk for _, chunk in _units(_layout(tiny_config(**base))))
    weights = plain.buffers["weights"]
    assert offload.offload and not plain.offload and offload.buffers == plain.buffers
    assert offload.device_bytes == 0 and plain.device_bytes == weights
    # Off the device: the shards; onto it: the two units in flight's shards, copied in.
    assert offload.transient_bytes == plain.transient_bytes + 2 * chunk * 2
    assert offload.device_peak_bytes == plain.device_peak_bytes - weights + 2 * chunk * 2
    # Onto the host, pinned: the shards; plus FSDP2's host copy of a unit's reduced gradient.
    assert offload.pinned_bytes == plain.pinned_bytes + weights
    assert offload.host_bytes == plain.host_bytes + weights + chunk * 2
    assert offload.startup_host_bytes == plain.startup_host_bytes + weights
    text = render(plan_run(tiny_config(**base, worker__offload_params=True)))
    assert "weight shards (offloaded)" in text and "weight shards offloaded to host RAM" in text


def test_offload_on_cpu_workers_is_noted_and_changes_nothing() -> None:
    plain = plan_run(tiny_config())
    offload = plan_run(tiny_config(worker__offload_params=True))
    assert not offload.worker.offload and offload.worker == plain.worker
    assert any("offload_params does nothing for CPU workers" in note for note in offload.notes)
    assert not any("offload_params" in note for note in plain.notes)


def test_the_workers_are_planned_on_gpus_when_they_reserve_them() -> None:
    """worker.gpus says where the workers compute: a device memory given for CPU workers
    is noted as not checked, not taken as a reason to plan them on GPUs."""
    gpu = ClusterDescription(device_memory_bytes=1 << 30)
    on_cpu = plan_run(tiny_config(), gpu)
    assert on_cpu.worker.device == "cpu" and "device memory per worker" not in {c.resource for c in on_cpu.checks}
    assert any("device memory given is not checked: worker.gpus is 0" in note for note in on_cpu.notes)
    on_gpu = plan_run(tiny_config(worker__gpus=1), gpu)
    assert on_gpu.worker.device == "cuda" and "device memory per worker" in {c.resource for c in on_gpu.checks}
    assert not any("device memory given" in note for note in on_gpu.notes)


def test_activation_checkpointing_keeps_only_each_blocks_input() -> None:
    """Korthikanti et al.: 34·s·b·h bytes per layer at 2-byte activations (GPT: 4h MLP);
    checkpointed, s·b·h per layer plus one layer recomputed. Both plus the logits."""
    config = tiny_config(model__n_layer=4)
    off, blocks = plan_run(config), plan_run(tiny_config(model__n_layer=4, worker__activation_checkpointing="blocks"))
    tokens, width, vocab = 4 * 32, 64, 256
    per_layer, logits = 34 * tokens * width * 4 // 2, tokens * vocab * (4 + 8)
    assert off.worker.activation_bytes == 4 * per_layer + logits
    assert blocks.worker.activation_bytes == 4 * tokens * width * 4 + per_layer + logits
    assert blocks.worker.activation_bytes < off.worker.activation_bytes
    assert blocks.worker.device_peak_bytes - off.worker.device_peak_bytes == (
        blocks.worker.activation_bytes - off.worker.activation_bytes
    )
    assert "activation checkpointing blocks" in render(blocks)


def test_activations_follow_an_hf_models_mlp(tmp_path: Path) -> None:
    """A gated MLP (Llama's SwiGLU) keeps 4 tensors of its width I, an ungated one 2."""
    transformers = pytest.importorskip("transformers")
    llama = tmp_path / "llama"
    transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(llama)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=64).save_pretrained(gpt2)
    tokens = 4 * 32
    for path, intermediate, up in ((llama, 176, 2), (gpt2, 4 * 64, 1)):
        plan = plan_run(tiny_config(hf__config_path=str(path), data__block_size=32))
        assert plan.worker.units == 3
        per_layer = tokens * (18 * 64 + 4 * up * intermediate) * 4 // 2
        assert plan.worker.activation_bytes == 3 * per_layer + tokens * 300 * (4 + 8), path.name


# --- a state server ------------------------------------------------------------------------
def test_all_state_in_ram_without_a_budget() -> None:
    plan = plan_run(tiny_config(state_server__num_servers=2))
    layout = _layout(tiny_config(state_server__num_servers=2))
    for server in plan.servers:
        start, stop = layout.server_range(server.index)
        assert server.elements == stop - start
        assert server.ram_state_bytes == STATE_BYTES_PER_ELEMENT * server.elements
        assert server.nvme_state_bytes == server.nvme_file_bytes == server.staging_bytes == 0
        segments = layout.segments_of_server(server.index)
        assert server.partitions == len(segments)  # one partition per segment
        # clipping on: every gradient is staged beside its partition, fp32 here
        assert server.ram_resident_bytes == sum(
            FileLayout(s.numel).file_bytes + gradient_file_bytes(s.numel, 4) for s in segments
        )
        assert server.gradient_bytes == 4 * min(server.elements, sum(s.numel for s in segments))


def test_nvme_holds_the_state_not_kept_in_ram(tmp_path: Path) -> None:
    config = tiny_config(state_server__num_servers=2, state_server__tier=nvme_tier(tmp_path))
    plan = plan_run(config)
    tier: TierConfig = config.state_server.tier
    for server in plan.servers:
        assert server.ram_state_bytes + server.nvme_state_bytes == STATE_BYTES_PER_ELEMENT * server.elements
        assert 0 < server.nvme_state_bytes and 0 < server.ram_state_bytes
        assert server.staging_bytes == tier.staging_bytes()
        assert server.ram_bytes <= tier.ram_budget_bytes  # resident partitions + staging within the budget
        # Files are the state in its file layout (a 4 KiB header and each array padded to
        # 4 KiB) and, clipping on, each disk partition's staged fp32 gradient (padded likewise).
        on_disk, with_gradients = server.partitions_on_nvme, server.nvme_state_bytes * 16 // 12
        assert with_gradients < server.nvme_file_bytes <= with_gradients + on_disk * 5 * 4096
        assert sum(server.nvme_bytes_by_path.values()) == server.nvme_file_bytes
        assert set(server.nvme_bytes_by_path) == set(tier.nvme_paths)
        assert server.nvme_need_bytes == server.nvme_file_bytes + server.staging_bytes
        assert server.traffic.nvme_write_bytes == server.traffic.nvme_read_bytes == server.nvme_file_bytes
    bigger = plan_run(
        tiny_config(state_server__num_servers=2, state_server__tier=nvme_tier(tmp_path, ram_budget_bytes=640 << 10))
    )
    assert all(b.nvme_state_bytes < s.nvme_state_bytes for b, s in zip(bigger.servers, plan.servers))


def test_the_plan_is_the_tier_storages_own(tmp_path: Path) -> None:
    """Register server 0's segments with a real TieredStorage (real files): its planner
    places the same bytes in each tier as the plan says."""
    config = tiny_config(state_server__tier=nvme_tier(tmp_path))
    plan, layout = plan_run(config), _layout(config)
    storage = TieredStorage(config.state_server.tier, server_index=0)
    try:
        for segment in layout.segments_of_server(0):
            storage.add_segment(
                "plan",
                segment.segment_id,
                segment.numel,
                [(f.segment_start, f.length) for f in segment.fragments],
                tensor_source(torch.zeros(segment.numel)),
                gradient_itemsize=4,  # fp32 pushes, as SegmentState registers them
            )
        summary = storage.summary()
    finally:
        storage.close()
    server = plan.servers[0]
    assert summary.planned_ram_bytes == server.ram_resident_bytes
    assert 0 < server.nvme_gradient_bytes < summary.planned_nvme_bytes
    assert summary.planned_nvme_bytes + server.nvme_gradient_bytes == server.nvme_file_bytes
    assert summary.staging_bytes == server.staging_bytes


def test_checkpoints_are_planned_per_tier(tmp_path: Path) -> None:
    """All in RAM a checkpoint copies the state (its partition files' layout: 12 B/param
    plus headers and padding, of server RAM) and writes all of it; with the NVMe tier it
    writes only the RAM-resident partitions and hard-links the rest, copying nothing in
    RAM."""
    ram = plan_run(tiny_config(checkpoint__dir=str(tmp_path / "checkpoints"), checkpoint__keep_last=2))
    tiered = plan_run(
        tiny_config(checkpoint__dir=str(tmp_path / "checkpoints"), state_server__tier=nvme_tier(tmp_path))
    )
    off = plan_run(tiny_config())
    server = ram.servers[0]
    assert server.checkpoint_snapshot_bytes == server.checkpoint_bytes  # the copy is laid out like the files
    assert server.checkpoint_written_bytes == server.checkpoint_bytes > server.elements * 12
    assert server.ram_peak_bytes == off.servers[0].ram_peak_bytes + server.checkpoint_snapshot_bytes
    disk = tiered.servers[0]
    assert disk.checkpoint_snapshot_bytes == 0
    assert disk.checkpoint_written_bytes > 0
    assert disk.checkpoint_bytes - disk.checkpoint_written_bytes == disk.nvme_file_bytes - disk.nvme_gradient_bytes
    assert off.servers[0].checkpoint_bytes == 0 and "Per checkpoint" not in render(off)
    text = render(ram)
    assert "RAM: checkpoint snapshot" in text and "holds up to 3 while one is saved" in text
    assert "hard-linked from the NVMe tier" in render(tiered)
