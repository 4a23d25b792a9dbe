"""What each process of a run holds in host memory whatever the model: the Python
interpreter, torch, Ray's core worker and gRPC, gloo. Measured, not derived: the peak RSS
(VmHWM) of each role's process in a run of a tiny model on this project's CPU build of
torch (``benchmarks/host_memory.py --sizes tiny``; docs/benchmarks.md). A GPU worker
also maps the CUDA libraries and its context's host allocations, estimated apart."""

from __future__ import annotations

MiB = 1 << 20

DRIVER_RUNTIME_BYTES = 450 * MiB
"""The process that runs ``cargohold train`` (or the Python API): Ray's driver, the config,
the launcher."""
WORKER_RUNTIME_BYTES = 480 * MiB
"""A CPU worker actor before its model: torch, gloo, Ray, gRPC, the data reader."""
SERVER_RUNTIME_BYTES = 330 * MiB
"""A state server actor before its state: torch, Ray, the gRPC server and its threads."""
CUDA_RUNTIME_BYTES = 1024 * MiB
"""What a GPU worker adds on the host (the CUDA runtime, cuBLAS and NCCL mapped, the
context's host allocations): an estimate, not measured on this project's machines."""


def worker_runtime_bytes(device: str) -> int:
    """A worker's runtime on ``device`` ("cuda" or "cpu")."""
    return WORKER_RUNTIME_BYTES + (CUDA_RUNTIME_BYTES if device == "cuda" else 0)


RAY_HEAD_DAEMONS_BYTES = 380 * MiB
"""Ray's own processes on the node that starts Ray (the GCS, the autoscaler's monitor, the
dashboard head, the log monitor, the raylet, the dashboard and runtime-env agents), their
PSS summed on an idle node (Ray 2.60; docs/operations.md "One host budget"). Not in the
host budget: stated by ``cargohold plan`` so that a node leaves them room."""
RAY_NODE_DAEMONS_BYTES = 200 * MiB
"""Ray's own processes on every other node (the raylet, the log monitor and the two
agents), from the same measurement."""
RAY_IDLE_WORKER_BYTES = 45 * MiB
"""Each idle Ray worker process that Ray starts ahead of tasks, from the same measurement."""
