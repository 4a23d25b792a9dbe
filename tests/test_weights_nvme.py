"""Weights on NVMe (``worker.weights_nvme_path``): every block's chunks in a file, read into
a bounded window ahead of its forward and backward, written after each update. Training
must be bitwise what it is with the weights in memory, i.e. plain AdamW's; the window must
really bound what is in memory, and a damaged file must be named, not trained on."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from reference import reference_train, tiny_config
from step_runs import registry_masters, run_ranks
from system import mounted_tmpfs

from cargohold.cluster.sections import config_layout, config_task, model_spec, port_config
from cargohold.services.core.errors import CorruptPartitionError, TierError, TierSpaceError, TrainingError
from cargohold.services.data import dropout_seed
from cargohold.services.models.build import build_model, parameter_values
from cargohold.services.worker.device_port import LocalPort
from cargohold.services.worker.model_setup import (
    exchange_buffers,
    sharded_model,
    step_policy,
    weight_window,
)
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.sharding import local_tensors
from cargohold.services.worker.step import ShardedStep
from cargohold.services.worker.weight_files import WeightFiles
from cargohold.services.worker.window_schedule import (
    BACKWARD,
    FORWARD,
    WindowSchedule,
    pass_entries,
    reads_per_micro_batch,
)

NVME = "<nvme>"
"""Replaced by a folder of the test's own."""
LAYERS = 4
STRATEGIES = {
    "staged": dict(),
    "clipped": dict(optim__max_grad_norm=0.05),
    "immediate": dict(optim__max_grad_norm=0.0, optim__nonfinite="ignore"),
    "accumulated": dict(data__micro_batches=3),
    "delayed": dict(worker__delayed_update=True, worker__delayed_update_after_steps=2),
    "checkpointed-window-2": dict(worker__activation_checkpointing="blocks", worker__weight_window=2),
    "gathered-once": dict(worker__reshard_after_forward=False, optim__max_grad_norm=0.05),
    "gathered-once-checkpointed": dict(worker__reshard_after_forward=False, worker__activation_checkpointing="blocks"),
    # Every block gathered again for backward (strict ZeRO-3); and the last three kept
    # gathered, recomputed in backward without a read.
    "every-block-regathered": dict(worker__kept_gathered_units=0),
    "three-kept-checkpointed-window-2": dict(
        worker__kept_gathered_units=3, worker__activation_checkpointing="blocks", worker__weight_window=2
    ),
    # The chunks' storages fixed-size, as FSDP2's pin_memory() leaves them on a GPU node.
    "fixed-size-chunks": dict(),
    # Units below a block (attention, the MLP's two projections, embeddings and head apart),
    # each in a file of its own, under block-level recomputation, clipping triggered.
    "split-units-checkpointed": dict(
        worker__max_unit_params=20_000, worker__activation_checkpointing="blocks", optim__max_grad_norm=0.05
    ),
}


def _config(world: int, folder: str, overrides: dict):
    return tiny_config(
        steps=5,
        model__n_layer=LAYERS,
        worker__num_workers=world,
        worker__weights_nvme_path=folder,
        **overrides,
    )


def _train_all(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, overrides in STRATEGIES.items():
            config = _config(world, str(Path(folder) / "nvme"), overrides)
            _train(rank, config, Path(folder) / name)
    finally:
        dist.destroy_process_group()


def _train(rank: int, config, folder: Path) -> None:
    device = torch.device("cpu")
    model, units, layout = sharded_model(config_task(config), config.worker, config.state_server.num_servers, device)
    if folder.name == "fixed-size-chunks":
        _fix_chunk_storages(units[1:])
    window = weight_window(config.worker, model, units, layout, rank=rank, run_id="run")
    assert window is not None
    buffers = exchange_buffers(config.worker, config.push_dtype, layout)
    port_ = LocalPort(port_config(config), "run", resolve_param_groups(config.optim, layout.params))
    step = ShardedStep(
        model,
        units,
        layout,
        rank,
        port_,
        buffers,
        step_policy(config.optim, config.worker),
        device=device,
        window=window,
    )
    with torch.device("meta"):
        shapes = build_model(model_spec(config), config.data)
    step.register(lambda names: parameter_values(model_spec(config), shapes, names))
    data = config_task(config).open_data()
    micros = range(config.data.micro_batches)
    losses, peaks = [], []
    in_memory = _blocks_in_memory(step)
    for number in range(1, config.steps + 1):
        batches = [data.batch(number, rank, micro) for micro in micros]
        seeds = [dropout_seed(config.seed, number, rank, micro) for micro in micros]
        peak = [0]
        hooks = [u.module.register_forward_pre_hook(_counter(peak, in_memory)) for u in units[1:]]
        report = step.run(number, batches, config.optim.lr_at(number, config.steps), dropout_seeds=seeds)
        for hook in hooks:
            hook.remove()
        losses.append(report.loss)
        peaks.append(peak[0])
        assert in_memory() == 0, "blocks left in memory after the step"
    weights = step.newest_weights()
    files = sorted(os.listdir(window.files.folder))
    step.close()
    masters = registry_masters(port_, layout)
    folder.mkdir(exist_ok=True)
    torch.save(
        {"losses": losses, "weights": weights, "masters": masters, "peaks": peaks, "files": files},
        folder / f"{rank}.pt",
    )


def _fix_chunk_storages(units) -> None:
    """Swap each block chunk's storage for a fixed-size one (numpy-backed, like the one
    Tensor.pin_memory() makes), in both of FSDP2's tensors of the chunk."""
    with torch.no_grad():
        for unit in units:
            for fsdp_param in unit.module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                data, local = fsdp_param._sharded_param_data, fsdp_param.sharded_param._local_tensor
                fixed = torch.from_numpy(np.zeros(data.numel() * data.element_size(), dtype=np.uint8))
                fixed.copy_(data.view(torch.uint8))
                storage = fixed.untyped_storage()
                assert not storage.resizable()
                data.set_(storage, 0, data.size(), data.stride())
                local.set_(storage, local.storage_offset(), local.size(), local.stride())


def _counter(peak: list[int], in_memory):
    def count(*_args) -> None:
        peak[0] = max(peak[0], in_memory())

    return count


def _blocks_in_memory(step: ShardedStep):
    tensors = local_tensors(step.model, step.layout)
    units = step.layout.units[1:]

    def count() -> int:
        return sum(any(t.untyped_storage().nbytes() for t in tensors[u.first_param : u.stop_param]) for u in units)

    return count


@pytest.mark.parametrize("world", [1, 2])
def test_weights_on_nvme_train_bitwise_as_adamw(world: int) -> None:
    with tempfile.TemporaryDirectory(prefix="cargohold-weights-") as folder:
        results = run_ranks(_train_all, world, folder, STRATEGIES)
        assert not os.listdir(Path(folder) / "nvme"), "weight files left behind"
    for name, ranks in results.items():
        config = _config(world, "/unused", STRATEGIES[name])
        layout = config_layout(config)[2]
        clipping = config.optim.max_grad_norm < 1
        reference = reference_train(config, config.steps, norm="shards" if clipping else "torch")
        assert ranks[0]["losses"] == reference.losses, name
        expected = reference.flat(layout)
        masters = torch.cat([r["masters"] for r in ranks])
        assert torch.equal(masters, expected), f"{name}: max abs diff {(masters - expected).abs().max():.3e}"
        assert torch.equal(torch.cat([r["weights"] for r in ranks]), expected), name
        window = config.worker.weight_window
        for r in ranks:
            assert 1 <= max(r["peaks"]) <= window, (name, r["peaks"])
            units = range(1, len(layout.units))
            assert r["files"] == [".lock"] + [f"unit-{u:05d}.weights" for u in units], r["files"]
        if name.startswith("split-units"):
            assert len(layout.units) == 1 + 3 + 3 * LAYERS, "wte, wpe, head and 3 units per block"


# --- the files on their own: damage between steps, full and read-only disks -----------------


def _files(root: Path, rank: int = 0, total: int = 1 << 20) -> WeightFiles:
    return WeightFiles(str(root), "run-w", rank, largest_bytes=64 << 10, total_bytes=total)


def test_a_weight_file_damaged_between_steps_is_named_not_trained_on(tmp_path: Path) -> None:
    files = _files(tmp_path)
    try:
        weights = torch.arange(10_000, dtype=torch.float32).to(torch.bfloat16)
        for unit in (1, 2, 3):
            files.write(unit, weights + unit)
        buffer = files.read(2)
        got = buffer.tensor[: weights.numel() * 2].view(torch.bfloat16).clone()
        files.done(buffer)
        assert torch.equal(got, weights + 2)
        path = Path(files.file_of(1))
        data = bytearray(path.read_bytes())
        data[5000] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptPartitionError, match=rf"{path}.*checksum mismatch") as corrupt:
            files.read(1)
        assert corrupt.value.path == str(path)
        path = Path(files.file_of(2))
        os.truncate(path, 4096)
        with pytest.raises(CorruptPartitionError, match=rf"{path}.*truncated"):
            files.read(2)
        Path(files.file_of(3)).unlink()
        with pytest.raises(CorruptPartitionError, match=r"unit-00003.weights.*missing"):
            files.read(3)
        with pytest.raises(TierError, match=r"unit-00004.weights was never written"):
            files.read(4)
        assert files.buffers.allocated_bytes <= 2 * files.buffers.nbytes
    finally:
        files.close()
    assert not any(tmp_path.iterdir()), "the worker's folder and its run's were not removed"


def test_a_second_worker_with_the_same_folder_is_refused(tmp_path: Path) -> None:
    files = _files(tmp_path)
    try:
        with pytest.raises(TierError, match=r"worker-0 is in use by another live process"):
            _files(tmp_path)
        _files(tmp_path, rank=1).close()  # another rank's folder is its own
    finally:
        files.close()


def test_full_and_read_only_disks_are_refused_naming_the_key(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "256k") as small:
        with pytest.raises(TierSpaceError, match=r"worker.weights_nvme_path: .* bytes free but this worker's weight"):
            _files(small, total=1 << 20)
        files = _files(small, total=64 << 10)
        try:
            ballast = small / "ballast"
            fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
            try:  # fill what is left
                while os.write(fd, b"x" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
            with pytest.raises(
                TierSpaceError, match=r"worker.weights_nvme_path: writing the weights file .*unit-00001"
            ):
                files.write(1, torch.zeros(16 << 10, dtype=torch.bfloat16))
        finally:
            files.close()
            ballast.unlink()
    with mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as read_only:
        with pytest.raises(TierError, match=r"worker.weights_nvme_path: cannot create .*Read-only file system"):
            _files(read_only)


# --- the schedule on its own -------------------------------------------------------------


def test_the_schedule_reads_each_block_once_per_gather_unless_the_window_still_holds_it() -> None:
    blocks = range(1, 9)
    assert reads_per_micro_batch(blocks, window=3, backward=blocks) == [1, 2, 3, 4, 5, 6, 7, 8, 5, 4, 3, 2, 1]
    assert reads_per_micro_batch(blocks, window=2, backward=blocks) == [1, 2, 3, 4, 5, 6, 7, 8, 6, 5, 4, 3, 2, 1]
    assert reads_per_micro_batch(blocks, window=8, backward=blocks) == list(blocks)
    assert reads_per_micro_batch(blocks, window=2, backward=()) == list(blocks)
    # The last three blocks kept gathered from forward to backward: none of them read again.
    assert reads_per_micro_batch(blocks, window=2, backward=range(1, 6)) == [1, 2, 3, 4, 5, 6, 7, 8, 5, 4, 3, 2, 1]


def test_the_schedule_keeps_within_the_window_unless_a_gather_comes_out_of_turn() -> None:
    schedule = WindowSchedule(2)
    assert pass_entries([1, 2, 3], backward=[1, 2]) == [
        (FORWARD, 1),
        (FORWARD, 2),
        (FORWARD, 3),
        (BACKWARD, 2),
        (BACKWARD, 1),
    ]
    assert schedule.begin(pass_entries([1, 2, 3, 4], backward=[1, 2, 3, 4])) == [1, 2]
    assert schedule.ensure((FORWARD, 1)) == [] and schedule.resident == {1, 2}
    # FSDP2 gathering block 4's backward ahead of time: taken beyond the window.
    assert schedule.ensure((BACKWARD, 4)) == [3, 4] and schedule.resident == {1, 2, 3, 4}
    assert schedule.release((FORWARD, 1)) == (1, [])  # the room lets B3 and B2 be taken: both in memory
    assert schedule.release((FORWARD, 2)) == (None, [])  # its backward use holds it now
    assert schedule.release((FORWARD, 4)) == (None, [])
    assert schedule.release((FORWARD, 3)) == (None, []) and schedule.resident == {2, 3, 4}
    with pytest.raises(TrainingError, match="outside the laid-out passes"):
        schedule.ensure((FORWARD, 9))
    with pytest.raises(TrainingError, match="still in memory"):
        schedule.begin(pass_entries([1], backward=()))
    assert schedule.reset() == {2, 3, 4} and schedule.resident == set()
    with pytest.raises(TrainingError, match=">= 2"):
        WindowSchedule(1)
