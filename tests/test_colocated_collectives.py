"""FSDP2's collectives through shared memory (services/worker/colocated_collectives.py): the same
bits as gloo's at two ranks, the documented order at three, in pieces when a collective
is larger than a region's half, gloo kept on every rank when any rank cannot join, and a
clear error, not a hang, when a peer exits.
Real processes, a real gloo group on loopback, real memfds; the training contract
(tests/test_training_contract.py) runs every sharded case on them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port

from cargohold.services.core.errors import InvalidTensorError, TrainingError
from cargohold.services.transport.shm import RegionCache
from cargohold.services.worker import colocated_collectives
from cargohold.services.worker.colocated_collectives import connect
from cargohold.services.worker.shared_barrier import POLL_S

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1000, 40_003)
"""Elements per rank; 40_003 fp32 x 3 ranks is larger than the small half (pieces)."""
SMALL_HALF = 64 << 10
RUN = "run-a"


def _data(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input (``world * n``), the same on every rank, with
    magnitudes spread so that the order of a sum shows in its bits."""
    generator = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.randint(-3, 3, (world, world * n), generator=generator)
    return list((torch.randn(world, world * n, generator=generator) * spread).to(dtype))


def _collectives(rank: int, world: int, port: int, out: Path, half: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        shared = connect(dist.group.WORLD, half, RUN)
        assert shared is not None
        results = {}
        for dtype in DTYPES:
            for n in SIZES:
                inputs = _data(world, n, dtype, seed=n)
                mine = inputs[rank]
                gathered_gloo, gathered = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(gathered_gloo, mine[:n])
                shared.all_gather(gathered, mine[:n].clone())
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                    if op == dist.ReduceOp.AVG and dtype == torch.float16:
                        continue  # FSDP2 sums fp16 (dividing before and after): no average
                    gloo, ours = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(gloo, mine.clone(), op=op)
                    before = mine.clone()
                    shared.reduce_scatter(ours, mine, average=op == dist.ReduceOp.AVG)
                    assert torch.equal(mine, before)  # the input is only read
                    results[(str(dtype), n, str(op))] = (gloo, ours)
                results[(str(dtype), n, "gather")] = (gathered_gloo, gathered)
        shared.close()
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(world: int, tmp_path: Path, half: int = SMALL_HALF) -> list[dict]:
    mp.start_processes(_collectives, args=(world, free_port(), tmp_path, half), nprocs=world, start_method="spawn")
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


@pytest.mark.integration
def test_two_ranks_give_gloos_bits(tmp_path: Path) -> None:
    for rank, results in enumerate(_run(2, tmp_path)):
        for key, (gloo, ours) in results.items():
            assert torch.equal(gloo, ours), (rank, key)


@pytest.mark.integration
def test_three_ranks_sum_in_the_documented_order(tmp_path: Path) -> None:
    """Gathers equal gloo's; reduce-scatters sum rank r's chunk over ranks r-1, r-2, ..., r
    exactly, which is within a rounding of the exact sum (gloo's own order varies)."""
    world = 3
    for rank, results in enumerate(_run(world, tmp_path)):
        for dtype in DTYPES:
            for n in SIZES:
                gathered_gloo, gathered = results[(str(dtype), n, "gather")]
                assert torch.equal(gathered_gloo, gathered), (rank, dtype, n)
                inputs = [x[rank * n : (rank + 1) * n] for x in _data(world, n, dtype, seed=n)]
                for op in ("RedOpType.SUM", "RedOpType.AVG"):
                    if (key := (str(dtype), n, op)) not in results:
                        continue
                    gloo, ours = results[key]
                    expected = inputs[(rank - 1) % world].clone()
                    for k in ((rank - 2) % world, rank):
                        expected += inputs[k]
                    if op == "RedOpType.AVG":
                        expected /= world
                    assert torch.equal(ours, expected), (rank, key)
                    # Each of the W - 1 additions and the division rounds once: off the
                    # exact sum by at most eps per rounding of the magnitudes summed.
                    divisor = world if op == "RedOpType.AVG" else 1
                    exact = sum(x.double() for x in inputs) / divisor
                    bound = world * torch.finfo(dtype).eps * sum(x.double().abs() for x in inputs) / divisor
                    assert ((ours.double() - exact).abs() <= bound).all(), (rank, key)
                    assert ((gloo.double() - exact).abs() <= bound).all(), (rank, key)


def _refused(rank: int, port: int, out: Path, how: str) -> None:
    """Rank 1 is elsewhere (another host) or cannot map its peer's region: every rank
    must come back with None, or the next collective would hang half on gloo."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1 and how == "other-host":
            colocated_collectives.host_identity = lambda: "elsewhere/0"  # type: ignore[assignment]
        if rank == 1 and how == "unmappable":
            colocated_collectives._open_peer = _unmappable  # type: ignore[assignment]
        shared = connect(dist.group.WORLD, SMALL_HALF, RUN)
        fds = len(os.listdir("/proc/self/fd"))
        x = torch.full((4,), float(rank + 1))
        dist.all_reduce(x)  # gloo still answers on both
        torch.save((shared is None, x.tolist(), fds), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _unmappable(path: str, run_id: str, rank: int):
    raise OSError(13, "Permission denied", path)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["other-host", "unmappable"])
def test_every_rank_keeps_gloo_when_one_cannot_join(tmp_path: Path, how: str) -> None:
    mp.start_processes(_refused, args=(free_port(), tmp_path, how), nprocs=2, start_method="spawn")
    for rank in range(2):
        refused, summed, _ = torch.load(tmp_path / f"rank{rank}.pt")
        assert refused, rank
        assert summed == [3.0] * 4


def _peer_exits(rank: int, port: int, out: Path) -> None:
    """Rank 1 exits once joined; rank 0's next collective must fail naming it, not hang."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shared = connect(dist.group.WORLD, SMALL_HALF, RUN)
    assert shared is not None
    shared.all_gather(torch.empty(8), torch.ones(4))  # both ranks there: passes
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        shared.all_gather(torch.empty(8), torch.ones(4))
        outcome = "passed"
    except TrainingError as error:
        outcome = str(error)
    (out / "outcome.txt").write_text(f"{outcome}\n{time.monotonic() - started}")
    shared.close()


@pytest.mark.integration
@pytest.mark.timeout(120)  # without the liveness check rank 0 would wait TIMEOUT_S (30 min)
def test_a_collective_fails_naming_a_peer_that_exited(tmp_path: Path) -> None:
    mp.start_processes(_peer_exits, args=(free_port(), tmp_path), nprocs=2, start_method="spawn")
    outcome, seconds = (tmp_path / "outcome.txt").read_text().splitlines()
    assert outcome.startswith("rank 1 (pid ") and "exited while rank 0 waited for it in a collective" in outcome
    assert float(seconds) < 10 * POLL_S


def _regions_of_runs(rank: int, port: int, out: Path, runs: tuple[str, str]) -> None:
    """Each rank joins as a worker of ``runs[rank]``. Where both are one run, rank 0 also
    hands rank 1's region to a state server's check (``RegionCache``) for that run and
    for a run named ``collectives``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        shared = connect(dist.group.WORLD, SMALL_HALF, runs[rank])
        outcome: dict[str, object] = {"joined": shared is not None}
        if shared is not None:
            peer = shared._regions[1 - rank].path
            fd = os.open(peer, os.O_RDONLY)
            outcome["name"] = os.readlink(f"/proc/self/fd/{fd}")
            os.close(fd)
            if rank == 0:
                for run in ("collectives", RUN):
                    cache = RegionCache()
                    try:
                        cache.open(peer, run)
                        outcome[run] = "mapped"
                    except InvalidTensorError as error:
                        outcome[run] = str(error)
                    cache.close()
        dist.barrier()
        if shared is not None:
            shared.close()
        x = torch.full((4,), float(rank + 1))
        dist.all_reduce(x)  # gloo answers either way
        outcome["summed"] = x.tolist()
        torch.save(outcome, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_a_region_is_named_for_its_run_and_another_runs_server_refuses_it(tmp_path: Path) -> None:
    """Issue 40 row 12: a worker's collectives region was named ``collectives:rank-<r>``
    with no run id, so a state server of a run named ``collectives`` mapped another run's.
    Its name now carries the run id; that server refuses it, the run's own may map it."""
    mp.start_processes(_regions_of_runs, args=(free_port(), tmp_path, (RUN, RUN)), nprocs=2, start_method="spawn")
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2))
    assert first["joined"] and second["joined"]
    assert first["name"] == f"/memfd:cargohold-{RUN}:collectives-rank-1 (deleted)"
    assert second["name"] == f"/memfd:cargohold-{RUN}:collectives-rank-0 (deleted)"
    assert "does not belong to run 'collectives'" in str(first["collectives"])
    assert first[RUN] == "mapped"


@pytest.mark.integration
def test_ranks_of_different_runs_refuse_each_others_regions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Row 12, the workers' side: a rank maps a peer's region only when it is that rank's
    region of its own run, checked as a state server checks a worker's; otherwise every
    rank keeps gloo."""
    mp.start_processes(_regions_of_runs, args=(free_port(), tmp_path, (RUN, "run-b")), nprocs=2, start_method="spawn")
    for rank in range(2):
        outcome = torch.load(tmp_path / f"rank{rank}.pt")
        assert not outcome["joined"], rank
        assert outcome["summed"] == [3.0] * 4
