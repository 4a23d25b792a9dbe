"""The ``cargohold plan`` command: its cluster flags, the plan printed as a table or JSON,
and the exit status (0 fits, 3 does not fit; a bad config or cluster is a ConfigError,
which the CLI turns into 2)."""

from __future__ import annotations

import argparse
import json
import sys

from cargohold.cluster.plan.description import load_cluster
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.schema.train import TrainConfig

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags of ``cargohold plan``."""
    parser.add_argument("--cluster", metavar="FILE", help="YAML cluster description (see docs/operations.md)")
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of each worker's accelerator, e.g. 80GiB (workers with worker.gpus above 0); "
        "absent, their device memory is not checked",
    )
    parser.add_argument("--host-memory", metavar="SIZE", help="RAM of each node, e.g. 256GiB")
    parser.add_argument("--nvme", metavar="SIZE", help="free NVMe of each state server, e.g. 2TiB")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(config: TrainConfig, args: argparse.Namespace) -> int:
    """Print the plan; EXIT_FITS or EXIT_DOES_NOT_FIT. Raises ConfigError for a bad cluster."""
    cluster = load_cluster(
        args.cluster, config=config, device_memory=args.device_memory, host_memory=args.host_memory, nvme=args.nvme
    )
    plan = plan_run(config, cluster)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan), file=sys.stdout, flush=True)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
