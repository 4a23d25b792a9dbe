"""Starting Ray in a test, once more when its raylet misses Ray's fixed 30 s to register
with the GCS ("The current node timed out during startup"): on a loaded 2-core CI box it
once did, failing a whole module's fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import ray
from ray.cluster_utils import Cluster

if TYPE_CHECKING:
    import psutil

T = TypeVar("T")


def started_once_more(start: Callable[[], T]) -> T:
    """``start()``; if a Ray node timed out during start-up, stop what was half started
    and call it a second (and last) time."""
    try:
        return start()
    except Exception as error:  # Ray raises a bare Exception for it
        if "timed out during startup" not in str(error):
            raise
    # the half-started node is unreachable from here: its processes are stopped by hand
    stop_ray_processes()
    ray.shutdown()
    return start()


def stop_ray_processes() -> None:
    """Kill the Ray processes (GCS, raylets, monitors) this process started."""
    import psutil  # Ray's own copy (ray/thirdparty_files), importable once ray is

    ours = ray_processes()
    for process in ours:
        process.kill()
    psutil.wait_procs(ours, timeout=30)


def ray_processes() -> list[psutil.Process]:
    """This process's children (at any depth) that are Ray's."""
    import psutil

    def is_ray(process: psutil.Process) -> bool:
        try:
            return "ray" in " ".join(process.cmdline())
        except psutil.Error:  # gone meanwhile
            return False

    return [p for p in psutil.Process().children(recursive=True) if is_ray(p)]


@contextmanager
def cluster_of(*resources: str) -> Iterator[Cluster]:
    """A Ray cluster of several nodes on this machine, this process connected to it: a
    head without CPUs and a node of 2 CPUs per name in ``resources``, each with that
    custom resource (to pin actors to it)."""

    def start() -> Cluster:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            for resource in resources:
                cluster.add_node(num_cpus=2, resources={resource: 1})
        except Exception:
            cluster.shutdown()
            raise
        return cluster

    cluster = started_once_more(start)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
