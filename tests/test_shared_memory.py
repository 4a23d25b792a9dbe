"""The co-located fast path: gradients and weights through a worker's sealed memfd, with
gRPC carrying only the call. Same results as streaming; refuses any memory it should not
touch, cannot be crashed by its client, and leaves nothing behind."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from reference import tiny_config
from transport_server import (
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    assert_bitwise_equal,
    make_spec,
    scrape,
    serving,
    total,
    wait_until,
)

from cargohold.cluster.launcher import TrainingSession
from cargohold.services.transport import shm
from cargohold.services.transport.grpc_client import RemoteError
from cargohold.services.transport.limits import CallLimits
from cargohold.services.transport.shm import SharedRegion
from cargohold.v1 import state_server_pb2 as pb

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memfds on this host")


@pytest.fixture
def region():
    shared = SharedRegion.create(shm.region_name(RUN, f"test-{uuid.uuid4().hex}"), NUMEL * 8)
    yield shared
    shared.close()


def test_push_and_fetch_through_shared_memory_equal_streaming(region: SharedRegion) -> None:
    with serving() as s:
        spec_a, spec_b = make_spec(), make_spec(segment_id=1)
        s.client.register(spec_a, W0)
        s.client.register(spec_b, W0)
        gradients = region.tensor(torch.float32, 0, NUMEL)
        weights = region.tensor(torch.float32, NUMEL * 4, NUMEL)
        for step, gradient in ((1, G1), (2, G2)):
            gradients.copy_(gradient)
            s.client.push(RUN, 0, step, gradient, global_norm=GLOBAL_NORM, lr=LR, shm=(region.path, 0))
            s.client.push(RUN, 1, step, gradient, global_norm=GLOBAL_NORM, lr=LR)
            assert s.client.fetch(RUN, 0, step, "float32", NUMEL, shm=(region.path, NUMEL * 4)) is None
            assert_bitwise_equal(weights, s.client.fetch(RUN, 1, step, "float32", NUMEL))


def _updated_in_one_call(s, region: SharedRegion, step: int, gradient: torch.Tensor) -> None:
    """Segment 0 pushed and applied through shared memory, segment 1 staged and committed,
    each asking for its weights back in the same call (``weights_out``)."""
    region.tensor(torch.float32, 0, NUMEL).copy_(gradient)
    s.client.push(
        RUN, 0, step, gradient, global_norm=GLOBAL_NORM, lr=LR, shm=(region.path, 0),
        prepare="float32", weights_to=(region.path, NUMEL * 4),
    )  # fmt: skip
    s.client.push(RUN, 1, step, gradient, lr=LR, defer_update=True)
    s.client.commit(
        RUN, 1, step, global_norm=GLOBAL_NORM, lr=LR, prepare="float32",
        weights_to=(region.path, NUMEL * 8), numel=NUMEL,
    )  # fmt: skip


@pytest.fixture
def wide_region():
    shared = SharedRegion.create(shm.region_name(RUN, f"test-{uuid.uuid4().hex}"), NUMEL * 12)
    yield shared
    shared.close()


@pytest.mark.parametrize("server", ["current", "predating weights_out"])
def test_an_update_returns_its_weights_in_the_same_call(wide_region: SharedRegion, server: str) -> None:
    """A push that is applied and a commit write the new weights where the worker asked,
    the same bits as a fetch; from a server that ignores the field (one that predates it)
    the client fetches them itself."""
    with serving() as s:
        if server != "current":
            s.server.servicer._weights_out = lambda *args: None  # type: ignore[method-assign]  # ignores the field
        for segment in (0, 1):
            s.client.register(make_spec(segment_id=segment), W0)
        for step, gradient in ((1, G1), (2, G2)):
            _updated_in_one_call(s, wide_region, step, gradient)
            for segment in (0, 1):
                written = wide_region.tensor(torch.float32, NUMEL * 4 * (segment + 1), NUMEL)
                assert_bitwise_equal(written, s.client.fetch(RUN, segment, step, "float32", NUMEL))
        fetched = total(scrape(s.metrics.address), "cargohold_transport_sent_bytes_total", rpc="FetchWeights.shm")
        in_calls = sum(
            total(scrape(s.metrics.address), "cargohold_transport_sent_bytes_total", rpc=rpc)
            for rpc in ("PushGradient.shm", "CommitStep.shm")
        )
        expected = 2 * 2 * NUMEL * 4
        assert (fetched, in_calls) == ((0, expected) if server == "current" else (expected, 0))


def test_weights_out_is_checked_before_the_update(wide_region: SharedRegion) -> None:
    """Without a dtype to write them in, or pointing outside the worker's memory, the call
    is refused with INVALID_ARGUMENT and the staged step is not committed."""
    with serving() as s:
        s.client.register(make_spec(), W0)
        s.client.push(RUN, 0, 1, G1, lr=LR, defer_update=True)
        key = pb.ShardKey(run_id=RUN, shard_id=0)
        inside = pb.SharedMemoryRef(path=wide_region.path, byte_offset=0)
        outside = pb.SharedMemoryRef(path=wide_region.path, byte_offset=NUMEL * 12 - 4)
        for request, message in (
            (
                pb.CommitStepRequest(key=key, step=1, global_grad_norm=GLOBAL_NORM, lr=LR, weights_out=inside),
                "needs their dtype (prepare_dtype)",
            ),
            (
                pb.CommitStepRequest(
                    key=key,
                    step=1,
                    global_grad_norm=GLOBAL_NORM,
                    lr=LR,
                    prepare_dtype=pb.DTYPE_FLOAT32,
                    weights_out=outside,
                ),
                "does not fit",
            ),
        ):
            with pytest.raises(grpc.RpcError) as error:
                s.stub.CommitStep(request, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()
        assert s.client.describe(RUN, 0)[1] == 0


def _memfd(name: str, size: int, *, sealed: bool) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
    return fd


@pytest.mark.parametrize(
    "case, message",
    [
        ("a file in /dev/shm", "is not allowed"),
        ("a relative path", "is not allowed"),
        ("a NUL byte", "is not allowed"),
        ("no such descriptor", "cannot open shared memory"),
        ("a regular file", "not a memfd sealed"),
        ("an unsealed memfd", "not a memfd sealed"),
        ("another run's memfd", "does not belong to run"),
        ("past the end", "does not fit"),
        ("misaligned", "does not fit"),
    ],
)
def test_bad_shared_memory_references_are_refused_and_change_nothing(region, case, message) -> None:
    """Each refused with INVALID_ARGUMENT naming why; the segment keeps its state."""
    with tempfile.TemporaryFile() as regular:
        regular.truncate(NUMEL * 8)
        unsealed = _memfd(f"cargohold-{RUN}:unsealed", NUMEL * 8, sealed=False)
        foreign = _memfd("cargohold-another-run-rank0", NUMEL * 8, sealed=True)
        try:
            path, offset = {
                "a file in /dev/shm": ("/dev/shm/cargohold-x", 0),
                "a relative path": (f"proc/{os.getpid()}/fd/{unsealed}", 0),
                "a NUL byte": (f"{region.path}\0", 0),
                "no such descriptor": (f"/proc/{os.getpid()}/fd/999999", 0),
                "a regular file": (f"/proc/{os.getpid()}/fd/{regular.fileno()}", 0),
                "an unsealed memfd": (f"/proc/{os.getpid()}/fd/{unsealed}", 0),
                "another run's memfd": (f"/proc/{os.getpid()}/fd/{foreign}", 0),
                "past the end": (region.path, NUMEL * 8 - 4),
                "misaligned": (region.path, 2),
            }[case]
            with serving() as s:
                s.client.register(make_spec(), W0)
                for call in (
                    lambda: s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(path, offset)),
                    lambda: s.client.fetch(RUN, 0, 0, "float32", NUMEL, shm=(path, offset)),
                ):
                    with pytest.raises(RemoteError) as error:
                        call()
                    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    assert message in error.value.details
                assert s.client.describe(RUN, 0)[1] == 0
                assert_bitwise_equal(s.client.fetch(RUN, 0, 0, "float32", NUMEL), W0)
        finally:
            os.close(unsealed)
            os.close(foreign)


def test_a_client_cannot_shrink_the_memory_under_the_server(region: SharedRegion) -> None:
    """A mapped file cut short makes its reader die of SIGBUS; a sealed memfd cannot be cut."""
    with serving() as s:
        s.client.register(make_spec(), W0)
        region.tensor(torch.float32, 0, NUMEL).copy_(G1)
        s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(region.path, 0))  # now mapped
        with open(region.path, "r+b") as other_handle:  # what any process with the path can do
            with pytest.raises(PermissionError):
                os.ftruncate(other_handle.fileno(), 0)
        assert s.client.fetch(RUN, 0, 1, "float32", NUMEL, shm=(region.path, NUMEL * 4)) is None
        assert_bitwise_equal(
            region.tensor(torch.float32, NUMEL * 4, NUMEL), s.client.fetch(RUN, 0, 1, "float32", NUMEL)
        )


def test_a_region_is_checked_again_when_its_path_names_another_file(region: SharedRegion) -> None:
    """The cache is keyed by inode: the same /proc path reused for another run's memfd is
    refused, not served from the mapping of the first."""
    with serving() as s:
        s.client.register(make_spec(), W0)
        first = _memfd(f"cargohold-{RUN}:first", NUMEL * 8, sealed=True)
        path = f"/proc/{os.getpid()}/fd/{first}"
        s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(path, 0))
        foreign = _memfd("cargohold-another-run-x", NUMEL * 8, sealed=True)
        os.dup2(foreign, first)  # the same path now names another run's memory
        os.close(foreign)
        try:
            with pytest.raises(RemoteError, match="does not belong to run"):
                s.client.fetch(RUN, 0, 1, "float32", NUMEL, shm=(path, 0))
        finally:
            os.close(first)


def test_a_cancelled_call_is_counted_as_cancelled_not_as_a_server_error(caplog) -> None:
    """A client that goes away mid-stream is not the server's failure: CANCELLED in the
    metrics, no ERROR traceback in the log."""
    release = threading.Event()

    def requests():
        yield pb.PushGradientRequest(
            header=pb.PushHeader(key=pb.ShardKey(run_id=RUN, shard_id=0), step=1, numel=NUMEL, dtype=pb.DTYPE_FLOAT32)
        )
        release.wait(30)

    with caplog.at_level(logging.INFO, logger="cargohold.services.server.servicer"), serving() as s:
        s.client.register(make_spec(), W0)
        # The register call holds its slot until gRPC has finished it, which can be after
        # its reply reached us: a push cancelled while that slot still reads 1 may never
        # have reached the server, which then rightly counts nothing.
        wait_until(lambda: s.server.calls_in_flight == 0, "the register call never released its slot")
        call = s.stub.PushGradient.future(requests(), timeout=30)
        wait_until(lambda: s.server.calls_in_flight == 1, "the server never admitted the push")
        call.cancel()
        try:  # the request generator stays blocked, so the client cannot half-close the stream first
            wait_until(
                lambda: total(
                    scrape(s.metrics.address), "cargohold_rpc_errors_total", rpc="PushGradient", code="CANCELLED"
                ),
                "the cancelled push was never counted",
            )
            samples = scrape(s.metrics.address)
        finally:
            release.set()
    counted = {
        dict(labels)["code"]: value
        for (name, labels), value in samples.items()
        if name == "cargohold_rpc_errors_total" and dict(labels).get("rpc") == "PushGradient" and value
    }
    assert counted == {"CANCELLED": 1}, counted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _received_by_rpc(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    return {
        s.labels["rpc"]: s.value
        for f in families
        if f.name == "cargohold_transport_received_bytes"
        for s in f.samples
        if s.name.endswith("total")
    }


@pytest.mark.integration
@pytest.mark.parametrize(("mode", "plane"), [("auto", "socket"), ("off", "socket"), ("off", "grpc")])
def test_a_colocated_run_uses_shared_memory_unless_off(ray_local, mode: str, plane: str) -> None:
    """Off, the bytes take the data plane a server on another node would get."""
    before = set(Path("/dev/shm").glob("*")) if Path("/dev/shm").is_dir() else set()
    config = tiny_config(steps=2, worker__shared_memory=mode, state_server__data_plane=plane)
    with TrainingSession(config) as session:
        session.step()
        session.step()
        received = _received_by_rpc(session.metrics_addresses()[0])
    paths = {rpc: received.get(rpc, 0) > 0 for rpc in ("PushGradient", "PushGradient.bulk", "PushGradient.shm")}
    used = "PushGradient.shm" if mode == "auto" else "PushGradient.bulk" if plane == "socket" else "PushGradient"
    assert paths == {rpc: rpc == used for rpc in paths}, received
    after = set(Path("/dev/shm").glob("*")) if Path("/dev/shm").is_dir() else set()
    assert not {p for p in after - before if session.run_id in p.name}, "no file is ever made for the buffers"


# --- issue 27: run ids that are prefixes of each other, what a client may map ---------


def _maps(name: str) -> int:
    """How many of this process's mappings are of memfds called ``name``."""
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{name} " in line or line.rstrip().endswith(f"/memfd:{name}") for line in maps)


def _refusal(s, path: str) -> RemoteError:
    with pytest.raises(RemoteError) as error:
        s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(path, 0))
    return error.value


@pytest.mark.parametrize("name", [f"cargohold-{RUN}-2-rank0-0123abcd", f"cargohold-{RUN}-2:rank0"])
def test_a_run_does_not_accept_the_buffers_of_a_run_its_id_is_a_prefix_of(name: str) -> None:
    """Runs ``run-a`` and ``run-a-2``, in the old naming and in the new: before, run-a's
    server accepted run-a-2's buffer (its name started with ``cargohold-run-a-``)."""
    fd = _memfd(name, NUMEL * 8, sealed=True)
    try:
        with serving() as s:
            s.client.register(make_spec(), W0)
            error = _refusal(s, f"/proc/{os.getpid()}/fd/{fd}")
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "does not belong to run" in error.details
            assert s.client.describe(RUN, 0)[1] == 0
    finally:
        os.close(fd)


def test_a_huge_sparse_region_is_refused_before_it_is_mapped() -> None:
    """Before: a 1 TiB memfd (no memory behind it) was mapped; a few filled the server's
    address space and later allocations failed for everyone."""
    name = f"cargohold-{RUN}:huge"
    fd = _memfd(name, 1 << 40, sealed=True)
    try:
        with serving() as s:
            s.client.register(make_spec(), W0)
            error = _refusal(s, f"/proc/{os.getpid()}/fd/{fd}")
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "a region may have at most" in error.details
            assert _maps(name) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "limits, refused",
    [
        (dict(region_bytes=1 << 20, client_bytes=1 << 30, total_bytes=1 << 30, client_regions=2), "process"),
        (dict(region_bytes=1 << 20, client_bytes=1 << 30, total_bytes=2 * NUMEL * 8), "this state server"),
    ],
    ids=["per client", "in all"],
)
def test_a_client_maps_no_more_than_its_bound_nor_the_server_more_than_its_own(limits: dict, refused: str) -> None:
    names = [f"cargohold-{RUN}:bounded-{i}" for i in range(3)]
    fds = [_memfd(name, NUMEL * 8, sealed=True) for name in names]
    try:
        with serving(limits=CallLimits(mapping=shm.MappingLimits(**limits))) as s:
            s.client.register(make_spec(), W0)
            for fd in fds[:2]:
                s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(f"/proc/{os.getpid()}/fd/{fd}", 0))
            error = _refusal(s, f"/proc/{os.getpid()}/fd/{fds[2]}")
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{refused}" in error.details
            assert _maps(names[2]) == 0
    finally:
        for fd in fds:
            os.close(fd)


_HOLDER = """
import fcntl, os, sys
fd = os.memfd_create(sys.argv[1], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.ftruncate(fd, int(sys.argv[2]))
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
print(f"/proc/{os.getpid()}/fd/{fd}", flush=True)
sys.stdin.read()
"""


def test_an_exited_clients_region_is_unmapped_without_another_call() -> None:
    """Before: the mapping (and its memory) stayed until the server's next shared-memory call."""
    name = f"cargohold-{RUN}:exiting-{uuid.uuid4().hex[:8]}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, name, str(NUMEL * 8)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        path = holder.stdout.readline().strip()
        with serving() as s:
            s.client.register(make_spec(), W0)
            assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(path, 0)).applied
            assert _maps(name) == 1
            holder.kill()
            holder.wait(10)
            deadline = time.monotonic() + 3 * shm.WATCH_INTERVAL_S + 1
            while _maps(name) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _maps(name) == 0
            assert s.server.servicer._regions.mapped == 0
    finally:
        holder.kill()
        holder.wait(10)


def _hugetlb(name: str) -> int:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as error:
        pytest.skip(f"no hugetlb memfds here: {error}")
    os.ftruncate(fd, os.fstat(fd).st_blksize)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
    return fd


@pytest.mark.parametrize("kind", ["write-sealed", "hugetlb"])
def test_a_memfd_the_server_cannot_use_is_invalid_argument_not_internal(kind: str, caplog) -> None:
    """Before: INTERNAL, with a traceback in the server's log (mmap failed)."""
    name = f"cargohold-{RUN}:{kind}"
    if kind == "hugetlb":
        fd = _hugetlb(name)
    else:
        fd = _memfd(name, NUMEL * 8, sealed=True)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    try:
        with caplog.at_level(logging.INFO), serving() as s:
            s.client.register(make_spec(), W0)
            error = _refusal(s, f"/proc/{os.getpid()}/fd/{fd}")
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error.details
            samples = scrape(s.metrics.address)
        assert total(samples, "cargohold_rpc_errors_total", rpc="PushGradient", code="INVALID_ARGUMENT") == 1
        assert total(samples, "cargohold_rpc_errors_total", rpc="PushGradient", code="INTERNAL") == 0
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        os.close(fd)
