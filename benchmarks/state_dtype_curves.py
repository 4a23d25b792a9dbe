"""The demo's loss curve with the moments stored as fp32, bf16 and 8-bit blocks.

    python benchmarks/state_dtype_curves.py run --kind float32 --out /tmp/sd-float32.json
    python benchmarks/state_dtype_curves.py run --kind blockwise8 --out /tmp/sd-blockwise8.json
    python benchmarks/state_dtype_curves.py compare /tmp/sd-float32.json /tmp/sd-blockwise8.json

``run`` trains what ``cargohold train --config examples/demo.yaml --set steps=200 --set
optim.state_dtype=KIND`` trains (the same config, through the same
``supervise.train``) and writes every step's loss and seconds as JSON; one run per
process, so several kinds run one after another rather than side by side. ``compare``
prints each curve's relative difference from the first file's (the fp32 one): at the last
step (signed), the largest over the steps and where, and the mean loss of the last 20
steps (signed); s/step leaves out the first 2 steps.
Nothing is asserted (tests/test_state_dtype.py holds the tolerances).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
TAIL = 20


def run(kind: str, steps: int, out: Path, extra: list[str]) -> None:
    from cargohold.cluster.schema.io import load_config
    from cargohold.cluster.supervise import train

    overrides = [f"steps={steps}", f"optim.state_dtype={kind}", *extra]
    result = train(load_config(DEMO, overrides))
    record = {"kind": kind, "overrides": overrides, "losses": result.losses, "seconds": result.step_seconds}
    out.write_text(json.dumps(record, indent=1))
    print(f"{kind}: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, wrote {out}")


def compare(paths: list[Path]) -> None:
    curves = [json.loads(path.read_text()) for path in paths]
    base = curves[0]["losses"]
    print(
        f"| `optim.state_dtype` | loss at step {len(base)} | relative to fp32 | largest per-step (step) "
        f"| mean of steps {len(base) - TAIL + 1}-{len(base)} | relative | s/step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for curve in curves:
        losses = curve["losses"]
        if len(losses) != len(base):
            raise SystemExit(f"{curve['kind']} has {len(losses)} steps, {curves[0]['kind']} {len(base)}")
        relative = [abs(a - b) / b for a, b in zip(losses, base)]
        worst = max(range(len(relative)), key=relative.__getitem__)
        tail, base_tail = sum(losses[-TAIL:]) / TAIL, sum(base[-TAIL:]) / TAIL
        seconds = curve["seconds"][2:] or curve["seconds"]
        last = (losses[-1] - base[-1]) / base[-1]
        print(
            f"| {curve['kind']} | {losses[-1]:.4f} | {last:+.3%} | {relative[worst]:.3%} ({worst + 1}) "
            f"| {tail:.4f} | {(tail - base_tail) / base_tail:+.3%} | {sum(seconds) / len(seconds):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="train the demo with one state_dtype, write its losses as JSON")
    one.add_argument("--kind", required=True, choices=["float32", "bfloat16", "blockwise8"])
    one.add_argument("--steps", type=int, default=200)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    both = commands.add_parser("compare", help="compare the JSON of runs with the first (fp32)")
    both.add_argument("paths", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run(args.kind, args.steps, args.out, args.overrides)
    else:
        compare(args.paths)


if __name__ == "__main__":
    main()
