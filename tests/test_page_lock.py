"""Exchange buffers a GPU worker page-locks in place: the shared memory its co-located
server reads the gradients from and writes the weights into (one path for CPU and GPU
workers). Where memory cannot be page-locked the buffers stay pageable, with one warning
naming the reason and a metric; the GPU-only parts run where CUDA is (make gpu-check)."""

from __future__ import annotations

import logging

import pytest
import torch

from cargohold.services.metrics.names import WORKER_PAGE_LOCK_FALLBACKS
from cargohold.services.metrics.worker import WorkerMetrics
from cargohold.services.transport.shm import RegionCache, region_name
from cargohold.services.worker.actor import report_pageable
from cargohold.services.worker.page_lock import PageLockRefused, cudart_path, page_lock
from cargohold.services.worker.state_port import ExchangeBuffers

RUN = "pagelock-run"
SLOT = 4096


def _allocate(*, shared: bool, pin: bool) -> ExchangeBuffers:
    return ExchangeBuffers.allocate(
        SLOT, torch.float32, torch.bfloat16, slots=2, shared_name=region_name(RUN, "rank0") if shared else None, pin=pin
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the buffers are page-locked (the gpu tests)")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_buffers_that_cannot_be_page_locked_stay_pageable_and_work(shared: bool) -> None:
    buffers = _allocate(shared=shared, pin=True)
    cache = RegionCache()
    try:
        assert buffers.lock is None and buffers.pin_refused is not None
        assert buffers.pin_refused.reason == "no_cuda"
        assert (buffers.region is not None) == shared
        slot = buffers.slots[1]
        slot.grads.copy_(torch.arange(SLOT, dtype=torch.float32))
        if shared:  # the server sees the gradient where the worker put it, and writes back
            path, offset = buffers.shared_ref(slot.grads)
            region = cache.open(path, RUN)
            assert torch.equal(region.tensor(torch.float32, offset, SLOT), slot.grads)
            path, offset = buffers.shared_ref(slot.weights)
            region.tensor(torch.bfloat16, offset, SLOT).fill_(1.5)
            assert torch.equal(slot.weights, torch.full((SLOT,), 1.5, dtype=torch.bfloat16))
    finally:
        cache.close()
        buffers.close()


def test_buffers_not_asked_to_pin_are_not() -> None:
    buffers = _allocate(shared=True, pin=False)
    try:
        assert buffers.lock is None and buffers.pin_refused is None
    finally:
        buffers.close()


def test_a_refusal_is_warned_once_naming_the_reason_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    metrics = WorkerMetrics(rank=3)
    refused = ExchangeBuffers([], pin_refused=PageLockRefused("cuda_error", "cudaHostRegister failed with error 2"))
    with caplog.at_level(logging.WARNING, logger="cargohold.services.worker.actor"):
        report_pageable(refused, 3, metrics)
        report_pageable(ExchangeBuffers([]), 3, metrics)  # pinned (or not asked): silent
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker 3" in warnings[0] and "cudaHostRegister failed" in warnings[0]
    sample = metrics.registry.get_sample_value(WORKER_PAGE_LOCK_FALLBACKS, {"rank": "3", "reason": "cuda_error"})
    assert sample == 1.0


def test_page_lock_refuses_without_cuda_naming_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(PageLockRefused, match="no CUDA device"):
        page_lock(torch.empty(4096, dtype=torch.uint8))


@pytest.mark.gpu
def test_a_gpu_workers_shared_buffers_are_page_locked_in_place_and_copied_by_dma() -> None:
    buffers = _allocate(shared=True, pin=True)
    cache = RegionCache()
    try:
        assert buffers.pin_refused is None and buffers.lock is not None
        slot = buffers.slots[0]
        assert slot.grads.is_pinned() and slot.weights.is_pinned()
        gradient = torch.randn(SLOT, device="cuda")
        slot.grads.copy_(gradient, non_blocking=True)  # device to host, straight into the region
        torch.cuda.current_stream().synchronize()
        path, offset = buffers.shared_ref(slot.grads)
        region = cache.open(path, RUN)  # what the co-located server maps
        assert torch.equal(region.tensor(torch.float32, offset, SLOT), gradient.cpu())
        path, offset = buffers.shared_ref(slot.weights)
        region.tensor(torch.bfloat16, offset, SLOT).fill_(2.0)
        back = slot.weights.to("cuda", non_blocking=True)
        assert torch.equal(back.cpu(), torch.full((SLOT,), 2.0, dtype=torch.bfloat16))
    finally:
        cache.close()
        buffers.close()


MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000001000-7f0000002000 rw-p 00000000 00:00 0
7f0000002000-7f0000003000 r-xp 00001000 08:01 456 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000004000-7f0000005000 r--p 00000000 08:01 789 /opt/x/libcudart_static_wrapper (deleted)
"""


def test_the_cuda_runtime_is_found_in_the_process_mappings() -> None:
    assert cudart_path(MAPS) == "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    assert cudart_path(MAPS.replace("libcudart.so.13", "libcublas.so.13")) is None


@pytest.mark.gpu
def test_a_refused_registration_does_not_fail_the_next_kernel() -> None:
    """A failed cudaHostRegister stays the thread's last CUDA error until read, and torch's
    next launch check would raise it: here registering the same memory twice fails."""
    memory = torch.empty(SLOT, dtype=torch.uint8)
    locks = []
    try:
        with pytest.raises(PageLockRefused, match="cudaHostRegister of"):
            locks.append(page_lock(memory))  # refused here where nothing can be pinned,
            locks.append(page_lock(memory))  # else as memory already registered (error 712)
        values = torch.ones(SLOT, device="cuda").add_(1)  # a kernel launch, checked by torch
        torch.cuda.synchronize()
        assert float(values.sum()) == 2 * SLOT
    finally:
        for lock in locks:
            lock.release()
