"""Why the 8-bit moments' loss spikes on the tests' tiny config (issue 25, item 2).

    python benchmarks/state_dtype_spike.py              # ~1 min on 2 cores, no Ray

The tiny config (tests/reference.py's ``tiny_config``, 2 workers, 2 servers) trained in
this process by the tests' reference loop (torch's ``AdamW(fused=True)``), its moments
rounded after every update through ``state_precision.encode`` and ``decode`` in the blocks
the servers use (256 elements from each segment's start, across the parameters of the
flat space): the same losses as the Ray run of tests/test_state_dtype.py. Then the same
loop with the rounding changed, each line a curve's relative difference from fp32's loss
(the largest and its step, the mean, the last of 20 steps):

* which moment: only ``exp_avg`` or only ``exp_avg_sq`` rounded;
* which parameters: tensors below 4096 elements kept fp32 (bitsandbytes'
  ``min_8bit_size``), the embeddings kept fp32, blocks per tensor instead of the flat
  space's;
* the direction error of one step: for each of the fp32 run's updates, how far
  ``exp_avg / sqrt(exp_avg_sq)`` moves when both are rounded, per parameter (the worst);
* the config's sensitivity: fp32 moments with seeded random relative noise of 0.3-3% on
  ``exp_avg_sq`` after every update (bf16's rounding is up to 0.39%), other seeds of the
  config, and a lower lr;
* 200 steps, with the tiny config's AdamW and with the demo's (lr 1e-3, beta2 0.95,
  clipping at 1), two seeds each.

Nothing is asserted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference loop
import reference  # noqa: E402
from reference import reference_train, tiny_config  # noqa: E402

from cargohold.cluster.schema.train import TrainConfig  # noqa: E402
from cargohold.services.core.layout import Layout, gather_params, scatter_params  # noqa: E402
from cargohold.services.core.state_precision import MOMENTS, Moment, StateDtype, decode, encode  # noqa: E402
from cargohold.services.worker.model_setup import model_layout  # noqa: E402

State = dict[str, dict[str, torch.Tensor]]
"""AdamW's state by parameter name."""
Rounding = Callable[[State], None]


def train_with(config: TrainConfig, after_update: Rounding | None = None, steps: int = 20) -> list[float]:
    """The reference run's losses, ``after_update`` changing AdamW's state after every update."""
    original = reference.torch_adamw

    def patched(cfg: TrainConfig, params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
        optimizer = original(cfg, params)
        names = {id(p): name for name, p in params.items()}
        step = optimizer.step

        def step_then_change(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = step(*args, **kwargs)
            if after_update is not None:
                after_update({names[id(p)]: optimizer.state[p] for p in optimizer.state})
            return out

        optimizer.step = step_then_change  # type: ignore[method-assign]
        return optimizer

    reference.torch_adamw = patched
    try:
        return reference_train(config, steps).losses
    finally:
        reference.torch_adamw = original


def rounded(layout: Layout, state: State, kind: StateDtype, moment: Moment) -> dict[str, torch.Tensor]:
    """``moment`` of every parameter after a round trip through ``kind``, segment by segment
    of the flat space, as the servers store it."""
    flat = scatter_params(layout, {name: s[moment] for name, s in state.items()})
    out = flat.clone()
    for segment in layout.segments:
        out[segment.start : segment.stop] = decode(encode(flat[segment.start : segment.stop], kind, moment))
    return gather_params(layout, out)


def stored_as(
    layout: Layout,
    kind: StateDtype,
    moments: tuple[Moment, ...] = MOMENTS,
    keep: Callable[[str, int], bool] = lambda name, numel: False,
    per_tensor: bool = False,
) -> Rounding:
    """Round ``moments`` through ``kind`` after each update, but the parameters ``keep``
    names; ``per_tensor``: each parameter in its own blocks."""

    def apply(state: State) -> None:
        for moment in moments:
            values = None if per_tensor else rounded(layout, state, kind, moment)
            for name, s in state.items():
                if keep(name, s[moment].numel()):
                    continue
                flat = s[moment].reshape(-1)
                new = decode(encode(flat.contiguous(), kind, moment)) if values is None else values[name].reshape(-1)
                flat.copy_(new)

    return apply


def noisy(sigma: float, seed: int) -> Rounding:
    """fp32 ``exp_avg_sq`` times (1 + sigma N(0, 1)) per element after each update."""
    generator = torch.Generator().manual_seed(seed)

    def apply(state: State) -> None:
        for s in state.values():
            v = s["exp_avg_sq"]
            v.mul_(1 + sigma * torch.randn(v.shape, generator=generator)).clamp_(min=0)

    return apply


def direction_errors(layout: Layout, per_step: list[tuple[int, str, float]]) -> Rounding:
    """Record, after each update of an fp32 run, the parameter whose ``exp_avg /
    sqrt(exp_avg_sq)`` moves most (relative L2) when both moments are stored as 8 bits."""

    def apply(state: State) -> None:
        m, v = (rounded(layout, state, "blockwise8", moment) for moment in MOMENTS)
        errors = {}
        for name, s in state.items():
            exact = s["exp_avg"] / (s["exp_avg_sq"].sqrt() + 1e-8)
            errors[name] = float((m[name] / (v[name].sqrt() + 1e-8) - exact).norm() / exact.norm())
        worst = max(errors, key=errors.__getitem__)
        per_step.append((int(next(iter(state.values()))["step"]), worst, errors[worst]))

    return apply


def summary(losses: list[float], fp32: list[float]) -> str:
    relative = [abs(a - b) / b for a, b in zip(losses, fp32)]
    worst = max(range(len(relative)), key=relative.__getitem__)
    return (
        f"largest {relative[worst]:7.2%} (step {worst + 1:2}), mean {sum(relative) / len(relative):6.2%}, "
        f"last {relative[-1]:6.2%}"
    )


def main() -> None:
    config = tiny_config(state_server__num_servers=2)
    layout = model_layout(config)[2]
    fp32 = train_with(config)
    print("fp32 losses:", " ".join(f"{loss:.4f}" for loss in fp32))
    small = "tensors < 4096 elements fp32"
    variants: dict[str, Rounding] = {
        "bfloat16": stored_as(layout, "bfloat16"),
        "blockwise8": stored_as(layout, "blockwise8"),
        "blockwise8, exp_avg only": stored_as(layout, "blockwise8", moments=("exp_avg",)),
        "blockwise8, exp_avg_sq only": stored_as(layout, "blockwise8", moments=("exp_avg_sq",)),
        f"blockwise8, {small}": stored_as(layout, "blockwise8", keep=lambda name, numel: numel < 4096),
        "blockwise8, embeddings fp32": stored_as(
            layout, "blockwise8", keep=lambda name, numel: name in ("wte.weight", "wpe.weight")
        ),
        "blockwise8, blocks per tensor": stored_as(layout, "blockwise8", per_tensor=True),
    }
    for name, rounding in variants.items():
        print(f"{name:40} {summary(train_with(config, rounding), fp32)}")
    per_step: list[tuple[int, str, float]] = []
    train_with(config, direction_errors(layout, per_step), steps=12)
    print("8-bit direction error, worst parameter per update:")
    print("  " + ", ".join(f"{step}: {name} {error:.1%}" for step, name, error in per_step))
    for sigma in (0.003, 0.01, 0.03):
        for seed in (1, 2, 3):
            losses = train_with(config, noisy(sigma, seed))
            print(f"fp32, {sigma:.1%} noise on exp_avg_sq (seed {seed}) {summary(losses, fp32)}")
    for seed in (1, 3, 5):
        other = tiny_config(state_server__num_servers=2, seed=seed)
        base, ours = train_with(other), stored_as(model_layout(other)[2], "blockwise8")
        kept = stored_as(model_layout(other)[2], "blockwise8", keep=lambda name, numel: numel < 4096)
        print(f"seed {seed}: blockwise8 {summary(train_with(other, ours), base)}")
        print(f"seed {seed}: blockwise8, {small} {summary(train_with(other, kept), base)}")
    slower = tiny_config(state_server__num_servers=2, optim__lr=0.003)
    ours = stored_as(model_layout(slower)[2], "blockwise8")
    print(f"lr 0.003: blockwise8 {summary(train_with(slower, ours), train_with(slower))}")
    long_runs()


DEMO_ADAMW = {
    "optim__lr": 1e-3,
    "optim__betas": [0.9, 0.95],
    "optim__weight_decay": 0.01,
    "optim__max_grad_norm": 1.0,
    "optim__warmup_steps": 10,
}
"""examples/demo.yaml's AdamW (tests/test_state_dtype.py's 200-step test uses it)."""


def long_runs(steps: int = 200) -> None:
    """200 steps with the tiny config's AdamW (lr 0.01, beta2 0.999) and the demo's, two
    seeds each: each kind and fp32 with 0.3% noise on exp_avg_sq against fp32."""
    for label, adamw in (("lr 0.01", {}), ("demo AdamW", DEMO_ADAMW)):
        for seed in (7, 1):
            config = tiny_config(state_server__num_servers=2, steps=steps, seed=seed, **adamw)
            layout = model_layout(config)[2]
            fp32 = train_with(config, steps=steps)
            curves: dict[str, Rounding] = {
                "bfloat16": stored_as(layout, "bfloat16"),
                "blockwise8": stored_as(layout, "blockwise8"),
                "fp32, 0.3% noise on exp_avg_sq": noisy(0.003, 1),
            }
            for name, rounding in curves.items():
                losses = train_with(config, rounding, steps=steps)
                print(f"{steps} steps, {label}, seed {seed}: {name:31} {summary(losses, fp32)}")


if __name__ == "__main__":
    main()
