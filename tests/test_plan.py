"""`cargohold plan`: the arithmetic on small configs, the cluster description and size
parsing, the command's exit codes and JSON, the shipped plan examples (13B on one 24 GiB
GPU, 70B on eight), and the plan checked against a real run.

Margins against a real run (test_plan_matches_a_real_run, test_worker_buffers_match_a_real_run):
* worker buffers (TrainingWorker.resident_bytes: FSDP2 weight shards and exchange
  buffers) and the bytes pushed and fetched per step: equal, no margin;
* a state server's state per tier (12 B/element): equal once every partition sits in its
  planned tier (partitions move after their next update; compared after 3 steps);
* the memory its tiers hold (RAM tier + staging buffers, in the 4 KiB-aligned file
  layout) and the NVMe bytes written per step: equal;
* NVMe bytes read per step: at most the planned bytes and at least the planned bytes less
  the staging buffers (partitions still staged from the previous step are not read).
The device-side figures (units in flight, gradients in backward, temporaries,
activations) are bounds and estimates; here only their arithmetic is tested.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cargohold.cluster import cli
from cargohold.cluster.config import TierConfig
from cargohold.cluster.plan.command import EXIT_DOES_NOT_FIT
from cargohold.cluster.plan.description import ClusterDescription, NodeGroup, load_cluster
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.sizes import format_bytes, parse_size
from cargohold.services.errors import ConfigError
from cargohold.services.layout import Layout
from cargohold.services.model_setup import model_layout
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.partitions import STATE_BYTES_PER_ELEMENT
from cargohold.services.tiers.storage import TieredStorage, tensor_source
from tests.reference import tiny_config

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

NVME_TIER = {"ram_budget_bytes": 320 << 10, "partition_bytes": 64 << 10, "buffer_count": 3, "io_threads": 2}
"""The bitwise NVMe contract test's tier: ~1.6 MiB of state, most of it on disk."""


def _tier(tmp_path: Path, **overrides) -> dict:
    return {**NVME_TIER, "nvme_paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], **overrides}


def _layout(config) -> Layout:
    return model_layout(config)[2]


def _units(layout: Layout) -> list[tuple[int, int]]:
    """(parameter elements, padded chunk per worker) of each FSDP2 unit, root first."""
    slots = [layout.group_params(g.index) for g in layout.groups]
    return [(sum(s.numel for s in unit), sum(s.slot_numel for s in unit)) for unit in slots]


def _exchange(layout: Layout, bytes_per_element: int, slots: int = 3) -> int:
    """Bytes of ``slots`` exchange slots of the largest unit (rounded up to 64 elements)."""
    largest = max(group.stop - group.start for group in layout.groups)
    return slots * (-(-largest // 64) * 64) * bytes_per_element


# --- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 << 30),
        ("512MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("100Gi", 100 << 30),
        ("4096", 4096),
        (" 2 kib ", 2048),
        ("64k", 64_000),
        ("1e3", 1000),
        (1 << 40, 1 << 40),
        ("0", 0),
    ],
)
def test_parse_size(text, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24GB!", "GiB", "-1GiB", "1.5", "0.1KiB", "12 gigs", "", "1e400", True])
def test_parse_size_refuses_with_a_clear_message(text) -> None:
    with pytest.raises(ConfigError, match="--host-memory"):
        parse_size(text, "--host-memory")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 33 << 30, int(37.1 * (1 << 30)), 3 << 40)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "33 GiB",
        "37.1 GiB",
        "3 TiB",
    ]


# --- the arithmetic ------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_worker_buffers_follow_the_layout(num_workers: int) -> None:
    config = tiny_config(worker__num_workers=num_workers)
    plan, layout = plan_run(config), _layout(config)
    assert plan.flat_elements == layout.total == num_workers * layout.worker_size
    # Rank 0's FSDP2 shards (it holds the most) and its exchange buffers, fp32 both ways.
    shards = sum(slot.local_numel(0) for slot in layout.params)
    assert shards >= max(sum(slot.local_numel(r) for slot in layout.params) for r in range(num_workers))
    assert plan.worker.buffers == {"weights": 4 * shards, "exchange": _exchange(layout, 8)}
    assert plan.worker.range_elements == layout.worker_size and plan.worker.blocks == 2
    traffic = plan.worker.traffic
    assert traffic.push_bytes == traffic.fetch_bytes == 4 * layout.worker_size
    chunks = [chunk for _, chunk in _units(layout)]
    assert traffic.reduce_scatter_bytes == (num_workers - 1) * sum(chunks) * 4
    # Every unit gathered in forward, the two blocks again in backward (the root stays).
    assert traffic.all_gather_bytes == (num_workers - 1) * (sum(chunks) + sum(chunks[1:])) * 4
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
    config = tiny_config(model__n_layer=4)
    resharded, kept = plan_run(config), plan_run(tiny_config(model__n_layer=4, worker__reshard_after_forward=False))
    block = _units(_layout(config))[1][0]
    assert kept.worker.gathered_bytes - resharded.worker.gathered_bytes == 2 * block * 4  # 4 blocks, not 2
    chunks = [chunk for _, chunk in _units(_layout(config))]
    assert resharded.worker.traffic.all_gather_bytes - kept.worker.traffic.all_gather_bytes == sum(chunks[1:]) * 4
    assert "root + 4 blocks gathered" in render(kept) and "root + 2 blocks gathered" in render(resharded)


def test_more_workers_shrink_the_shards_not_the_units() -> None:
    configs = {w: tiny_config(worker__num_workers=w, model__n_embd=128) for w in (1, 2, 4)}
    plans = {w: plan_run(c).worker for w, c in configs.items()}
    weights = {w: p.buffers["weights"] for w, p in plans.items()}
    exchange = {w: p.buffers["exchange"] for w, p in plans.items()}
    assert weights[1] > weights[2] > weights[4] and exchange[1] > exchange[2] > exchange[4]
    # 1/W of every parameter, rank 0 rounding its rows up: at most one row per parameter more.
    rows = sum(slot.row_numel for slot in _layout(configs[4]).params)
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
    largest = max(group.stop - group.start for group in layout.groups)
    assert largest < layout.worker_size / 2  # a slot is far smaller than the worker's range
    assert plan_run(config).worker.buffers["exchange"] == 5 * (-(-largest // 64) * 64) * 8


def test_a_gpu_worker_pins_its_exchange_buffers() -> None:
    config = tiny_config(worker__device="auto", worker__compute_dtype="bfloat16")
    plan = plan_run(config, ClusterDescription(device_memory_bytes=1 << 30))
    w = plan.worker
    assert w.device == "cuda" and plan.transport == "grpc" and w.shared_memory_bytes == 0
    assert w.buffers["exchange"] == _exchange(_layout(config), 4 + 2) == w.pinned_bytes
    assert w.device_bytes == w.buffers["weights"]
    assert w.host_bytes == w.buffers["exchange"] + w.corpus_bytes
    on_cpu = plan_run(config)
    assert on_cpu.worker.device == "cpu" and on_cpu.worker.pinned_bytes == 0
    assert on_cpu.transport == "shared_memory" and on_cpu.worker.shared_memory_bytes == _exchange(_layout(config), 6)
    assert on_cpu.worker.host_bytes == (
        on_cpu.worker.device_peak_bytes + on_cpu.worker.buffers["exchange"] + on_cpu.worker.corpus_bytes
    )


def test_offload_moves_the_weights_from_the_device_to_pinned_host_memory() -> None:
    base = {"worker__device": "cuda", "worker__compute_dtype": "bfloat16", "model__n_layer": 4}
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
    plain = plan_run(tiny_config(worker__device="cpu"))
    offload = plan_run(tiny_config(worker__device="cpu", worker__offload_params=True))
    assert not offload.worker.offload and offload.worker == plain.worker
    assert any("offload_params does nothing for CPU workers" in note for note in offload.notes)
    assert not any("offload_params" in note for note in plain.notes)


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
        plan = plan_run(tiny_config(hf__config_path=str(path)))
        assert plan.worker.blocks == 3
        per_layer = tokens * (18 * 64 + 4 * up * intermediate) * 4 // 2
        assert plan.worker.activation_bytes == 3 * per_layer + tokens * 300 * (4 + 8), path.name


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
        assert server.ram_resident_bytes == sum(FileLayout(s.numel).file_bytes for s in segments)
        assert server.gradient_bytes == 4 * server.elements  # clipping on: every gradient is staged


def test_nvme_holds_the_state_not_kept_in_ram(tmp_path: Path) -> None:
    config = tiny_config(state_server__num_servers=2, state_server__tier=_tier(tmp_path))
    plan = plan_run(config)
    tier: TierConfig = config.state_server.tier
    for server in plan.servers:
        assert server.ram_state_bytes + server.nvme_state_bytes == STATE_BYTES_PER_ELEMENT * server.elements
        assert 0 < server.nvme_state_bytes and 0 < server.ram_state_bytes
        assert server.staging_bytes == tier.staging_bytes()
        assert server.ram_bytes <= tier.ram_budget_bytes  # resident partitions + staging within the budget
        # Files are the state in its file layout: a 4 KiB header and each array padded to 4 KiB.
        on_disk = server.partitions_on_nvme
        assert server.nvme_state_bytes < server.nvme_file_bytes <= server.nvme_state_bytes + on_disk * 4 * 4096
        assert sum(server.nvme_bytes_by_path.values()) == server.nvme_file_bytes
        assert set(server.nvme_bytes_by_path) == set(tier.nvme_paths)
        assert server.nvme_need_bytes == server.nvme_file_bytes + server.staging_bytes
        assert server.traffic.nvme_write_bytes == server.traffic.nvme_read_bytes == server.nvme_file_bytes
    bigger = plan_run(
        tiny_config(state_server__num_servers=2, state_server__tier=_tier(tmp_path, ram_budget_bytes=640 << 10))
    )
    assert all(b.nvme_state_bytes < s.nvme_state_bytes for b, s in zip(bigger.servers, plan.servers))


def test_the_plan_is_the_tier_storages_own(tmp_path: Path) -> None:
    """Register server 0's segments with a real TieredStorage (real files): its planner
    places the same bytes in each tier as the plan says."""
    config = tiny_config(state_server__tier=_tier(tmp_path))
    plan, layout = plan_run(config), _layout(config)
    storage = TieredStorage(config.state_server.tier, server_index=0)
    try:
        for segment in layout.segments_of_server(0):
            storage.add_shard(
                "plan",
                segment.segment_id,
                segment.numel,
                [(f.segment_start, f.length) for f in segment.fragments],
                tensor_source(torch.zeros(segment.numel)),
            )
        summary = storage.summary()
    finally:
        storage.close()
    server = plan.servers[0]
    assert summary.planned_ram_bytes == server.ram_resident_bytes
    assert summary.planned_nvme_bytes == server.nvme_file_bytes
    assert summary.staging_bytes == server.staging_bytes


def test_render_shows_every_tier_and_the_verdict(tmp_path: Path) -> None:
    config = tiny_config(state_server__tier=_tier(tmp_path))
    text = render(plan_run(config, ClusterDescription(nvme_bytes=1 << 30)))
    for needle in (
        "Each worker",
        "Each state server",
        "state on NVMe",
        "NVMe writes",
        "push",
        "fetch",
        "activations (estimate)",
        "fits          NVMe of state server 0",
        "=> fits",
    ):
        assert needle in text, needle


def test_checkpoints_are_planned_per_tier(tmp_path: Path) -> None:
    """All in RAM a checkpoint copies the state (its partition files' layout: 12 B/param
    plus headers and padding, of server RAM) and writes all of it; with the NVMe tier it
    writes only the RAM-resident partitions and hard-links the rest, copying nothing in
    RAM."""
    ram = plan_run(tiny_config(checkpoint__dir=str(tmp_path), checkpoint__keep_last=2))
    tiered = plan_run(tiny_config(checkpoint__dir=str(tmp_path), state_server__tier=_tier(tmp_path)))
    off = plan_run(tiny_config())
    server = ram.servers[0]
    assert server.checkpoint_snapshot_bytes == server.checkpoint_bytes  # the copy is laid out like the files
    assert server.checkpoint_written_bytes == server.checkpoint_bytes > server.elements * 12
    assert server.ram_peak_bytes == off.servers[0].ram_peak_bytes + server.checkpoint_snapshot_bytes
    disk = tiered.servers[0]
    assert disk.checkpoint_snapshot_bytes == 0
    assert disk.checkpoint_written_bytes > 0
    assert disk.checkpoint_bytes - disk.checkpoint_written_bytes == disk.nvme_file_bytes
    assert off.servers[0].checkpoint_bytes == 0 and "Per checkpoint" not in render(off)
    text = render(ram)
    assert "RAM: checkpoint snapshot" in text and "holds up to 3 while one is saved" in text
    assert "hard-linked from the NVMe tier" in render(tiered)


# --- fitting -------------------------------------------------------------------------------
def test_checks_name_each_resource_and_its_shortfall(tmp_path: Path) -> None:
    config = tiny_config(worker__device="cuda", state_server__tier=_tier(tmp_path))
    plan = plan_run(config, ClusterDescription(device_memory_bytes=1 << 20, nvme_bytes=1 << 30))
    verdicts = {c.resource: c for c in plan.checks}
    device = verdicts["device memory per worker"]
    assert device.fits is False and device.need == plan.worker.device_peak_bytes and "short" in device.reason
    assert verdicts["NVMe of state server 0"].fits is True
    host = next(c for c in plan.checks if c.resource.startswith("host RAM"))
    assert host.fits is None and "--host-memory" in host.reason  # not given: not checked, not failed
    assert not plan.fits
    roomy = plan_run(config, ClusterDescription(device_memory_bytes=1 << 30, nvme_bytes=1 << 30))
    assert roomy.fits


def test_host_memory_counts_every_actor_on_a_node() -> None:
    config = tiny_config(worker__num_workers=4, state_server__num_servers=2)
    plan = plan_run(config)
    worker, server = plan.worker.host_peak_bytes, max(s.ram_peak_bytes for s in plan.servers)
    need = 4 * worker + 2 * server
    one_node = plan_run(config, ClusterDescription(nodes=(NodeGroup(workers=4, servers=2, host_memory_bytes=need),)))
    assert one_node.fits
    short = plan_run(config, ClusterDescription(nodes=(NodeGroup(workers=4, servers=2, host_memory_bytes=need - 1),)))
    assert not short.fits
    spread = ClusterDescription(nodes=(NodeGroup(count=2, workers=2, servers=1),))
    two = plan_run(config, spread)
    assert two.transport == "mixed"  # streams to the other node: the server holds the streamed copies too
    per_node = 2 * two.worker.host_peak_bytes + max(s.ram_peak_bytes for s in two.servers)
    assert per_node < need
    fitted = plan_run(
        config, ClusterDescription(nodes=(NodeGroup(count=2, workers=2, servers=1, host_memory_bytes=per_node),))
    )
    assert fitted.fits
    too_few = plan_run(config, ClusterDescription(nodes=(NodeGroup(count=1, workers=2, servers=2),)))
    slots = {c.resource: c for c in too_few.checks}["worker slots"]
    assert slots.fits is False and slots.need == 4 and slots.available == 2


def test_load_cluster_from_yaml_and_flags(tmp_path: Path) -> None:
    config = tiny_config(worker__num_workers=8, state_server__num_servers=2)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "device_memory: 80GiB\nnvme: 100Gi\nhost_memory: 64GiB\nnodes:\n"
        "  - {count: 1, workers: 8, host_memory: 480GiB}\n  - {count: 2, servers: 1}\n"
    )
    cluster = load_cluster(path, config=config)
    assert cluster.device_memory_bytes == 80 << 30 and cluster.nvme_bytes == 100 << 30
    assert cluster.nodes == (
        NodeGroup(count=1, workers=8, servers=0, host_memory_bytes=480 << 30),
        NodeGroup(count=2, workers=0, servers=1, host_memory_bytes=64 << 30),
    )
    flagged = load_cluster(path, config=config, nvme="2TiB")
    assert flagged.nvme_bytes == 2 << 40
    default = load_cluster(None, config=config, host_memory="256GiB")
    assert default.nodes == (NodeGroup(workers=8, servers=2, host_memory_bytes=256 << 30),)


@pytest.mark.parametrize(
    "text, message",
    [
        ("device_memry: 1GiB\n", "unknown cluster key 'device_memry'"),
        ("nodes:\n  - {count: 1, wokers: 2}\n", "unknown cluster key nodes[0].wokers"),
        ("nodes:\n  - {count: two}\n", "nodes[0].count must be an integer"),
        ("nvme: lots\n", "nvme (--nvme): cannot read 'lots'"),
        ("- 1\n", "must hold a mapping"),
        ("nodes: {count: 1}\n", "nodes must be a list"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_a_bad_cluster_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_cluster(path, config=tiny_config())
    assert message in str(error.value)


# --- the command ---------------------------------------------------------------------------
@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("model: {n_layer: 2, n_head: 2, n_embd: 64, block_size: 32}\ndata: {corpus_bytes: 100000}\n")
    return path


def test_cli_exits_0_when_it_fits(tiny_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), "--host-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits          host RAM per node" in out and "=> fits" in out


def test_cli_exits_3_when_it_does_not_fit(tiny_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), "--host-memory", "1MiB"]) == EXIT_DOES_NOT_FIT == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT  host RAM per node" in out and "=> does not fit" in out


def test_cli_json(tiny_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--config",
        str(tiny_yaml),
        "--json",
        "--device-memory",
        "1KiB",
        "--nvme",
        "1TB",
        "--set",
        "worker.device=cuda",
        "--set",
        "state_server.tier.ram_budget_bytes=327680",
        "--set",
        "state_server.tier.partition_bytes=65536",
        "--set",
        f"state_server.tier.nvme_paths=[{tmp_path / 'nvme'}]",
    ]
    assert cli.main(args) == 3
    data = json.loads(capsys.readouterr().out)
    expected = plan_run(*_cli_config(tiny_yaml, args))
    assert data["fits"] is False
    assert data["worker"]["buffers"] == expected.worker.buffers
    assert data["worker"]["device_peak_bytes"] == expected.worker.device_peak_bytes
    assert data["servers"][0]["nvme_file_bytes"] == expected.servers[0].nvme_file_bytes > 0
    assert data["servers"][0]["ram_peak_bytes"] == expected.servers[0].ram_peak_bytes
    checks = {c["resource"]: c for c in data["checks"]}
    assert checks["device memory per worker"]["fits"] is False
    assert checks["NVMe of state server 0"]["fits"] is True


def _cli_config(path: Path, args: list[str]):
    from cargohold.cluster.config import load_config

    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = load_config(path, overrides)
    return config, ClusterDescription(device_memory_bytes=1024, nvme_bytes=10**12)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host-memory", "24GB!"], "cannot read '24GB!' as a size"),
        (["--device-memory", "eighty"], "--device-memory"),
        (["--set", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["--set", "state_server.num_servers=100000"], "use fewer state servers"),
        (["--cluster", "/nonexistent/cluster.yaml"], "cannot read cluster file"),
    ],
)
def test_cli_exits_2_on_a_bad_config(
    tiny_yaml: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cargohold: bad configuration:") and message in err


# --- the shipped examples (plans, no run) ----------------------------------------------------
EXAMPLES = {
    # config: (cluster flags, workers, parameters)
    "examples/llama-13b-1gpu.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "256GiB", "--nvme", "2TiB"],
        1,
        13_015_864_320,
    ),
    "examples/llama-2-70b-8gpu.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "768GiB", "--nvme", "1TiB"],
        8,
        68_976_648_192,
    ),
}


@pytest.fixture
def at_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples name their hf config folder relative to the repository root."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("path", EXAMPLES)
def test_an_example_plan_fits_24_gib_gpus(
    at_the_repository_root, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cargohold.cluster.config import load_config

    flags, workers, parameters = EXAMPLES[path]
    assert cli.main(["plan", "--config", path, *flags]) == 0
    out = capsys.readouterr().out
    assert "\n=> fits\n" in out
    config = load_config(path)
    plan = plan_run(
        config, load_cluster(None, config=config, device_memory="24GiB", host_memory=flags[3], nvme=flags[5])
    )
    w = plan.worker
    assert plan.fits and plan.parameters == parameters and plan.num_workers == workers
    assert w.device == "cuda" and w.offload and w.activation_checkpointing == "blocks"
    assert w.device_bytes == 0 and w.device_peak_bytes < 20 * GiB  # headroom for the CUDA context and allocator
    assert w.pinned_bytes == w.buffers["weights"] + w.buffers["exchange"]
    # The optimizer state: 12 B/param, in part on NVMe.
    assert sum(s.ram_state_bytes + s.nvme_state_bytes for s in plan.servers) == 12 * parameters
    assert all(s.nvme_state_bytes > 0 for s in plan.servers)
    # Each example needs its offload: without it the GPU is too small.
    assert cli.main(["plan", "--config", path, *flags, "--set", "worker.offload_params=false"]) == EXIT_DOES_NOT_FIT
    assert "DOES NOT FIT  device memory per worker" in capsys.readouterr().out
    # docs/operations.md shows this very output.
    docs = (REPO / "docs" / "operations.md").read_text()
    assert f"$ cargohold plan --config {path} {' '.join(flags)}\n{out.rstrip()}\n```" in docs, (
        "docs/operations.md shows another plan; paste the command's output"
    )


def test_the_example_figures(at_the_repository_root) -> None:
    """The figures the examples' comments and the docs quote."""
    from cargohold.cluster.config import load_config

    def plan(path: str):
        flags = EXAMPLES[path][0]
        config = load_config(path)
        return plan_run(
            config, load_cluster(None, config=config, device_memory=flags[1], host_memory=flags[3], nvme=flags[5])
        )

    small, large = plan("examples/llama-13b-1gpu.yaml"), plan("examples/llama-2-70b-8gpu.yaml")
    assert format_bytes(small.worker.buffers["weights"]) == "24.2 GiB"  # the bf16 weights: the whole GPU
    assert format_bytes(small.worker.device_peak_bytes) == "11.4 GiB"
    assert format_bytes(small.worker.activation_bytes) == "1.78 GiB"
    assert format_bytes(large.worker.buffers["weights"]) == "16.1 GiB"  # 1/8 of the bf16 weights
    assert format_bytes(large.worker.device_peak_bytes) == "15.1 GiB"
    host = {c.resource: c for c in large.checks if c.resource.startswith("host RAM")}
    assert [format_bytes(c.need) for c in host.values()] == ["475 GiB"]
    assert format_bytes(small.worker.host_peak_bytes) == "31.6 GiB"  # shards + three unit-sized slots
    assert format_bytes(sum(s.nvme_state_bytes for s in large.servers)) == "708 GiB"


# --- against a real run ----------------------------------------------------------------------
def _scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels`` (an ``rpc`` prefix)."""
    rpc = labels.pop("rpc", None)
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name
        and all((k, x) in ls for k, x in labels.items())
        and (rpc is None or dict(ls).get("rpc", "").startswith(rpc))
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tiered", [False, True], ids=["all-ram", "nvme"])
def test_plan_matches_a_real_run(ray_local, tmp_path: Path, tiered: bool) -> None:
    from cargohold.cluster.launcher import TrainingSession
    from cargohold.services.checkpoint import CheckpointDir

    overrides = {"state_server__tier": _tier(tmp_path)} if tiered else {}
    config = tiny_config(steps=5, checkpoint__dir=str(tmp_path / "checkpoints"), **overrides)
    plan = plan_run(config)
    server_plan = plan.servers[0]
    assert (server_plan.nvme_state_bytes > 0) is tiered
    assert (server_plan.checkpoint_snapshot_bytes > 0) is not tiered

    with TrainingSession(config) as session:
        assert session.worker_resident_bytes() == plan.worker.buffers  # both are buffer sizes: equal
        targets = {(t.role, t.index): t.address for t in session.metrics_targets()}
        for _ in range(3):
            session.step()
        server = session.servers[0]
        by_tier = ray_get(server.__ray_call__.remote(lambda s: s.registry.bytes_by_tier()))
        summary = ray_get(server.__ray_call__.remote(lambda s: s.registry.storage.summary()))
        before = _scrape(targets[("state_server", 0)])
        session.step()
        session.step()
        after = _scrape(targets[("state_server", 0)])
        worker = _scrape(targets[("worker", 0)])
        store = CheckpointDir(tmp_path / "checkpoints")
        saved = session.checkpoint_finish(store, session.checkpoint_begin(store))

    # One checkpoint: the files the plan counts, written or hard-linked as it says.
    assert saved.written_bytes + saved.linked_bytes == server_plan.checkpoint_bytes
    assert saved.written_bytes == server_plan.checkpoint_written_bytes
    assert (saved.linked_bytes > 0) is tiered

    # State per tier (12 B/element), once every partition reached its planned tier.
    assert by_tier["ram"] == server_plan.ram_state_bytes
    assert by_tier.get("nvme", 0) == server_plan.nvme_state_bytes
    # Memory the tiers hold: resident partitions in file layout plus the staging buffers.
    assert summary.ram_used_bytes == server_plan.ram_bytes
    assert summary.planned_nvme_bytes == server_plan.nvme_file_bytes

    steps, sent, received = 5, "cargohold_transport_sent_bytes_total", "cargohold_transport_received_bytes_total"
    assert _total(worker, sent, rpc="PushGradient") == steps * plan.worker.traffic.push_bytes
    assert _total(worker, received, rpc="FetchWeights") == steps * plan.worker.traffic.fetch_bytes
    assert _total(after, received, rpc="PushGradient") == steps * server_plan.traffic.push_bytes
    assert _total(after, sent, rpc="FetchWeights") == steps * server_plan.traffic.fetch_bytes

    def per_step(name: str) -> float:
        return (_total(after, name) - _total(before, name)) / 2

    assert per_step("cargohold_tier_write_bytes_total") == server_plan.traffic.nvme_write_bytes
    read = per_step("cargohold_tier_read_bytes_total")
    planned = server_plan.traffic.nvme_read_bytes
    assert planned - server_plan.staging_bytes <= read <= planned


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_worker_buffers_match_a_real_run(ray_local) -> None:
    """bf16 weights and wire, 3 workers (uneven dim-0 shards: rank 0 holds the most),
    checkpointed blocks kept gathered: every worker's buffers are at most the plan's,
    rank 0's equal, and the bytes pushed and fetched are the plan's."""
    from cargohold.cluster.launcher import TrainingSession, worker_env

    config = tiny_config(
        steps=2,
        worker__num_workers=3,
        worker__compute_dtype="bfloat16",
        worker__grad_wire_dtype="bfloat16",
        worker__activation_checkpointing="blocks",
        worker__reshard_after_forward=False,
    )
    plan = plan_run(config)
    with TrainingSession(config) as session:
        resident = [ray_get(w.resident_bytes.remote()) for w in session.workers]
        malloc = [
            ray_get(w.__ray_call__.remote(lambda self: os.environ.get("MALLOC_MMAP_THRESHOLD_")))
            for w in session.workers
        ]
        address = {(t.role, t.index): t.address for t in session.metrics_targets()}[("worker", 0)]
        session.step()
        session.step()
        worker = _scrape(address)
    assert resident[0] == plan.worker.buffers
    assert malloc == [worker_env()["MALLOC_MMAP_THRESHOLD_"]] * 3  # FSDP2's unit buffers go back to the system
    assert all(r["exchange"] == plan.worker.buffers["exchange"] for r in resident)
    assert all(r["weights"] <= plan.worker.buffers["weights"] for r in resident)
    assert resident[-1]["weights"] < resident[0]["weights"]  # the last rank's chunks run short
    sent, received = "cargohold_transport_sent_bytes_total", "cargohold_transport_received_bytes_total"
    assert _total(worker, sent, rpc="PushGradient") == 2 * plan.worker.traffic.push_bytes
    assert _total(worker, received, rpc="FetchWeights") == 2 * plan.worker.traffic.fetch_bytes
