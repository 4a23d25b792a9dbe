"""The ``cargohold`` command.

    cargohold train                               # the embedded demo: local Ray, small GPT
    cargohold train --config examples/demo.yaml   # a config file
    cargohold train --config FILE --set steps=10 --set worker.num_workers=4
    cargohold plan --config FILE --device-memory 80GiB --host-memory 256GiB --nvme 2TiB

``cargohold plan`` starts nothing: it prints the memory and per-step traffic the run
needs and exits 0 when it fits, 3 when it does not (cluster/plan/).

Under ``ray job submit`` set ``cluster.address: auto`` (or ``--set cluster.address=auto``)
to join the job's cluster instead of starting one.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from cargohold.cluster.schema.io import load_config
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import CargoholdError, ConfigError

EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_CONFIG
    try:
        overrides = list(args.overrides)
        if getattr(args, "resume", None):
            overrides.append(f"checkpoint.resume={args.resume}")
        config = load_config(args.config, overrides)
        if args.command == "plan":
            from cargohold.cluster.plan.command import plan_command

            return plan_command(config, args)  # 0 fits, 3 does not; a bad cluster is a ConfigError
        from cargohold.cluster.sections import config_layout, config_task

        task = config_task(config)
        task.open_data()  # bad data (a missing file, a bad line) is a bad configuration too
        task.open_eval()
        if config.optim.param_groups:  # their patterns meet the model's parameter names
            from cargohold.services.worker.param_groups import resolve_param_groups

            resolve_param_groups(config.optim, config_layout(config, task)[2].params)
    except ConfigError as error:
        print(f"cargohold: bad configuration: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        return _train(config)
    except ConfigError as error:  # found once the run meets its checkpoint or nodes
        print(f"cargohold: bad configuration: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except CargoholdError as error:
        print(f"cargohold: training failed: {error}", file=sys.stderr)
        return EXIT_FAILURE


def _train(config: TrainConfig) -> int:
    from cargohold.trainer import Trainer  # the CLI is a thin layer over the Python API

    result = Trainer(config=config).fit()
    first, last = result.losses[0], result.losses[-1]
    mean_step = sum(result.step_seconds) / len(result.step_seconds)
    held_out = f", eval loss {result.evals[-1].loss:.4f} ppl {result.evals[-1].perplexity:.2f}" if result.evals else ""
    resumed = f" (resumed run {result.resumed_run_id} at step {result.first_step})" if result.resumed_run_id else ""
    documents = result.data_documents
    placed = (
        f"; {documents['documents']} documents whole in {documents['sequences']} sequences, over-long: "
        f"{documents['truncated']} truncated, {documents['dropped']} dropped, {documents['split']} split, "
        f"{documents['without_targets']} without a counted token"
        if documents
        else ""
    )
    skipped = f", {len(result.skipped_steps)} updates skipped" if result.skipped_steps else ""
    scale = f", loss scale {result.loss_scale:g}" if result.loss_scale is not None else ""
    print(
        f"run {result.run_id}{resumed}: {len(result.losses)} steps, loss {first:.4f} -> {last:.4f}{held_out}, "
        f"mean step {mean_step:.2f}s{skipped}{scale}{placed}",
        flush=True,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cargohold",
        description="Train models with Adam state offloaded to host state servers.",
        epilog="Docs: docs/architecture.md, docs/configuration.md",
    )
    parser.add_argument("--version", action="version", version=f"cargohold {metadata.version('cargohold')}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser("train", help="run a training job (the embedded demo by default)")
    train.add_argument("--config", metavar="FILE", help="YAML config; defaults apply to every key it omits")
    train.add_argument(
        "--resume", metavar="PATH|latest", help="continue from a checkpoint folder, or the latest in checkpoint.dir"
    )
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set steps=10 --set optim.lr=3e-4 (repeatable)",
    )
    plan = commands.add_parser(
        "plan",
        help="print the memory and traffic a run needs and whether it fits; "
        "starts nothing (exit 0 fits, 3 does not, 2 bad config)",
    )
    plan.add_argument("--config", metavar="FILE", help="YAML config; defaults apply to every key it omits")
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key (repeatable)",
    )
    from cargohold.cluster.plan.command import add_arguments

    add_arguments(plan)
    return parser


if __name__ == "__main__":
    sys.exit(main())
