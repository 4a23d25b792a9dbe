"""The cluster a plan is checked against: node groups (how many workers and state servers
each node runs, and its RAM), each worker's device memory and each state server's NVMe;
read from a YAML file and/or the command's flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cargohold.cluster.schema.io import read_yaml_mapping
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sizes import parse_size
from cargohold.services.core.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    """``count`` identical nodes, each running ``workers`` workers and ``servers`` state servers."""

    count: int = 1
    workers: int = 0
    servers: int = 0
    host_memory_bytes: int | None = None
    """RAM of each node; None leaves host memory unchecked."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"a node group's count must be >= 1, got {self.count}")
        if self.workers < 0 or self.servers < 0:
            raise ConfigError(f"a node group's workers and servers must be >= 0, got {self.workers}, {self.servers}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterDescription:
    """What the run will get. A YAML file holds the same keys, sizes as numbers of bytes or
    strings like ``80GiB``::

        device_memory: 80GiB      # each worker's accelerator (worker.gpus > 0); absent: unchecked
        nvme: 100GiB              # free NVMe of each state server (all its tier paths), and of
                                  # each node's workers' weight files (worker.weights_nvme_path)
        host_memory: 64GiB        # default RAM of a node (for groups that do not say)
        nodes:                    # absent: one node runs every worker and state server
          - {count: 1, workers: 8, servers: 0, host_memory: 480GiB}
          - {count: 2, workers: 0, servers: 1}
    """

    device_memory_bytes: int | None = None
    nvme_bytes: int | None = None
    nodes: tuple[NodeGroup, ...] = ()
    """Empty: one node holding every worker and state server of the config."""

    def groups(self, config: TrainConfig) -> tuple[NodeGroup, ...]:
        return self.nodes or (NodeGroup(workers=config.worker.num_workers, servers=config.state_server.num_servers),)


_CLUSTER_KEYS = {"device_memory", "nvme", "host_memory", "nodes"}
_GROUP_KEYS = {"count", "workers", "servers", "host_memory"}


def load_cluster(
    path: str | Path | None = None,
    *,
    config: TrainConfig,
    device_memory: str | None = None,
    host_memory: str | None = None,
    nvme: str | None = None,
) -> ClusterDescription:
    """The cluster from a YAML file and/or flags (a flag replaces the file's top-level key
    of the same name); ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml_mapping(path, "cluster file")
        unknown = sorted(set(data) - _CLUSTER_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown cluster key {unknown[0]!r}; known keys: {', '.join(sorted(_CLUSTER_KEYS))}")
    flags = {"device_memory": device_memory, "host_memory": host_memory, "nvme": nvme}
    data.update({k: v for k, v in flags.items() if v is not None})

    def size(mapping: Mapping[str, Any], key: str, what: str) -> int | None:
        value = mapping.get(key)
        return None if value is None else parse_size(value, what)

    host = size(data, "host_memory", "host_memory (--host-memory)")
    groups = []
    if not isinstance(data.get("nodes") or [], list):
        raise ConfigError(f"cluster nodes must be a list of node groups, got {data['nodes']!r}")
    for index, raw in enumerate(data.get("nodes") or ()):
        where = f"nodes[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"cluster {where} must be a mapping with keys {', '.join(sorted(_GROUP_KEYS))}")
        unknown = sorted(set(raw) - _GROUP_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown cluster key {where}.{unknown[0]}; known keys: {', '.join(sorted(_GROUP_KEYS))}")
        counts = {}
        for key, default in (("count", 1), ("workers", 0), ("servers", 0)):
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"cluster {where}.{key} must be an integer, got {value!r}")
            counts[key] = value
        groups.append(
            NodeGroup(
                **counts,
                host_memory_bytes=size(raw, "host_memory", f"{where}.host_memory") if "host_memory" in raw else host,
            )
        )
    if not groups:
        groups = [
            NodeGroup(
                workers=config.worker.num_workers, servers=config.state_server.num_servers, host_memory_bytes=host
            )
        ]
    return ClusterDescription(
        device_memory_bytes=size(data, "device_memory", "device_memory (--device-memory)"),
        nvme_bytes=size(data, "nvme", "nvme (--nvme)"),
        nodes=tuple(groups),
    )
