"""Plain single-process training with torch.optim.AdamW: the correctness reference.

It sees exactly the data the workers see (rank r's batch of each step), averages the
per-rank gradients in the order the workers reduce them, clips with
torch.nn.utils.clip_grad_norm_ and steps torch.optim.AdamW(fused=True) on fp32 master
weights. With a bf16 compute dtype the model it runs forward/backward on is the bf16
copy of the masters, as the workers hold.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from cargohold.cluster.config import TrainConfig, from_dict
from cargohold.services.data import batch_for_step, load_tokens
from cargohold.services.layout import ShardLayout, parameter_views
from cargohold.services.shard_state import WIRE_DTYPES
from cargohold.services.worker import build_model


@dataclass
class ReferenceResult:
    masters: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    losses: list[float]

    def flat(self, layout: ShardLayout, which: str = "masters") -> torch.Tensor:
        """The tensors of ``which`` laid out in the flat buffer (zeros in padding)."""
        flat = torch.zeros(layout.total, dtype=torch.float32)
        for view, tensor in zip(parameter_views(layout, flat), getattr(self, which)):
            view.copy_(tensor)
        return flat


def reference_train(config: TrainConfig, steps: int, *, threads: int = 1) -> ReferenceResult:
    """Train ``steps`` steps in this process; ``threads`` should equal the workers'."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(config, steps)
    finally:
        torch.set_num_threads(previous_threads)


def _train(config: TrainConfig, steps: int) -> ReferenceResult:
    world = config.worker.num_workers
    compute = WIRE_DTYPES[config.worker.compute_dtype]
    wire = WIRE_DTYPES[config.worker.grad_wire_dtype]
    master_model = build_model(config)
    masters = list(master_model.parameters())
    model = copy.deepcopy(master_model).to(compute)
    # Weights after each update (index 0: the initial ones). Step t computes on those of
    # update t-1, or of t-2 with the delayed parameter update once past its warm-up (the
    # first delayed step still computes on t-1: nothing was in flight before it).
    history = [[m.detach().clone() for m in masters]]
    warm_up = config.worker.delayed_update_after_steps
    o = config.optim
    optimizer = torch.optim.AdamW(
        masters, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    tokens = load_tokens(config.data.corpus_path, config.data.corpus_bytes, config.data.seed,
                         seq_len=config.model.block_size)
    losses = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            lag = 2 if config.worker.delayed_update and step > warm_up + 1 else 1
            for low, weights in zip(model.parameters(), history[max(step - lag, 0)]):
                low.copy_(weights)
        summed: list[torch.Tensor] | None = None
        step_loss = 0.0
        for rank in range(world):
            x, y = batch_for_step(tokens, step=step, rank=rank, world_size=world,
                                  batch_size=config.data.batch_size, seq_len=config.model.block_size,
                                  seed=config.data.seed)
            model.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            step_loss += float(loss.detach())
            grads = [p.grad.to(wire) for p in model.parameters()]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        losses.append(step_loss / world)
        for master, grad in zip(masters, summed):
            master.grad = (grad / world).to(torch.float32)
        if o.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(masters, o.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = o.lr_at(step, config.steps)
        optimizer.step()
        history.append([m.detach().clone() for m in masters])
    state = [optimizer.state[p] for p in masters]
    return ReferenceResult(
        masters=[p.detach().clone() for p in masters],
        exp_avg=[s["exp_avg"].clone() for s in state],
        exp_avg_sq=[s["exp_avg_sq"].clone() for s in state],
        losses=losses,
    )


def tiny_config(**overrides) -> TrainConfig:
    """A model small enough that a 20-step run takes seconds on 2 cores."""
    data = {
        "steps": 20,
        "seed": 7,
        "progress": False,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
        "data": {"batch_size": 4, "corpus_bytes": 100_000},
        "optim": {"lr": 0.01, "weight_decay": 0.1, "max_grad_norm": 1.0e6, "warmup_steps": 3,
                  "schedule": "cosine"},
        "worker": {"num_workers": 2, "cpus": 1, "torch_threads": 1},
        "state_server": {"num_servers": 1, "cpus": 1},
    }
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return from_dict(TrainConfig, data)
