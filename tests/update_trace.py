"""The package files one update crosses, traced rather than written down (issue 41: the
map in docs/architecture.md is checked against this).

One worker and one state server in one process, built from the same functions the worker
and the server actors use (services/worker/actor.py, services/server/state_server.py), with the default
settings (clipping on, so the update is staged; RAM tier). Step 1 warms everything up;
step 2 is traced with a profile function installed before any thread exists
(``threading.setprofile``). A file is on the update's path when, during step 2, it runs

- on the main thread inside FSDP2's gradient hook (``ShardedStep``'s ``hook``), where the
  unit's reduced gradient enters cargohold, or
- on any other thread: the worker's exchange pool (push, commit, weights back into the
  local shards) and the server's gRPC and bulk-socket threads.

``colocated``: the server shares the node (shared memory); otherwise it is remote (gRPC
and the bulk socket, as ``tuning.state_server.data_plane: socket``, the default).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = tuple(str(ROOT / d) + os.sep for d in ("services", "api", "cluster", "proto"))


class PathTracer:
    """Collects the package files that run on the update's path (see the module docstring)."""

    def __init__(self) -> None:
        self.recording = False
        self.files: set[str] = set()
        self._main = threading.main_thread().ident
        self._in_hook = 0

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.recording or event not in ("call", "return"):
            return
        code = frame.f_code
        on_main = threading.get_ident() == self._main
        if (
            on_main
            and code.co_name == "hook"
            and code.co_filename.endswith(os.path.join("services", "worker", "step.py"))
        ):
            self._in_hook += 1 if event == "call" else -1
        if event != "call" or (on_main and self._in_hook <= 0):
            return
        if code.co_filename.startswith(PACKAGE_DIRS):
            self.files.add(os.path.relpath(code.co_filename, ROOT))


def trace_update(colocated: bool) -> list[str]:
    """The package files (relative to the repository) one update crosses."""
    tracer = PathTracer()
    threading.setprofile(tracer.profile)
    sys.setprofile(tracer.profile)
    try:
        return _run(tracer, colocated)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _run(tracer: PathTracer, colocated: bool) -> list[str]:
    import torch
    import torch.distributed as dist

    from cargohold.cluster.schema.io import load_config
    from cargohold.cluster.sections import config_task, port_config
    from cargohold.services.data import dropout_seed
    from cargohold.services.metrics.worker import WorkerMetrics
    from cargohold.services.server.state_server import StateServer
    from cargohold.services.transport import shm
    from cargohold.services.transport.grpc_client import StateServerClient
    from cargohold.services.worker.model_setup import exchange_buffers, sharded_model, step_policy, weight_window
    from cargohold.services.worker.param_groups import resolve_param_groups
    from cargohold.services.worker.state_port import RemotePort
    from cargohold.services.worker.step import ShardedStep

    run_id = f"trace-{os.getpid()}"
    config = load_config(
        str(ROOT / "examples" / "tiny.yaml"),
        [
            "worker.num_workers=1",
            "metrics.port=null",
            f"tuning.worker.shared_memory={'auto' if colocated else 'off'}",
        ],
    )
    torch.set_num_threads(1)
    server = StateServer(config.state_server, run_id=run_id, server_index=0, metrics_enabled=False)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    client = StateServerClient(server.address(), bulk=config.state_server.data_plane == "socket")
    try:
        task = config_task(config)
        data = task.open_data()
        model, units, layout = sharded_model(task, config.worker, config.state_server.num_servers, torch.device("cpu"))
        shared = {0} if colocated else set()
        buffers = exchange_buffers(
            config.worker,
            config.push_dtype,
            layout,
            shared_name=shm.region_name(run_id, "rank0") if colocated else None,
        )
        param_groups = resolve_param_groups(config.optim, layout.params)
        port = RemotePort(port_config(config), run_id, [client], buffers, shared, WorkerMetrics(0), param_groups)
        window = weight_window(config.worker, model, units, layout, rank=0, run_id=run_id, observer=None)
        step = ShardedStep(
            model,
            units,
            layout,
            0,
            port,
            buffers,
            step_policy(config.optim, config.worker),
            device=torch.device("cpu"),
            loss=task.loss,
            window=window,
        )
        with torch.device("meta"):
            shapes = task.build()
        step.register(task.initial_values(shapes))
        for number in (1, 2):
            tracer.recording = number == 2
            batch = data.batch(number, 0, 0)
            step.run(
                number, [batch], config.optim.lr_at(number, config.steps), dropout_seeds=[dropout_seed(0, number, 0, 0)]
            )
            step.settle()
            tracer.recording = False
        step.close()
        buffers.close()
    finally:
        client.close()
        dist.destroy_process_group()
        server.stop()
    return sorted(tracer.files)


if __name__ == "__main__":
    print("\n".join(trace_update(colocated=sys.argv[1:] != ["remote"])))
