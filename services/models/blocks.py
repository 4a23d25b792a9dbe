"""The repeated transformer blocks of a model: FSDP2's units and the unit of activation
checkpointing.

Both work on meta-device models and leave parameter names as they are: the worker's
layout, the state servers and checkpoints all name parameters by ``named_parameters()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed._composable import checkpoint

from cargohold.services.core.errors import ConfigError


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of each repeated block, in forward order: the
    ``nn.ModuleList`` holding the most parameters whose members are all of one class and
    all hold parameters (the built-in GPT's ``blocks``, a transformers decoder's layers)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(member) for member in module}) != 1:
            continue
        if any(next(member.parameters(), None) is None for member in module):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise ConfigError(
            f"{_describe(model)} has no repeated block list (an nn.ModuleList of layers of one class) for FSDP2 to wrap"
        )
    _, name, blocks = best
    return [(f"{name}.{key}" if name else key, block) for key, block in blocks.named_children()]


def apply_activation_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    Uses torch's composable ``checkpoint`` (non-reentrant ``torch.utils.checkpoint`` run
    from forward hooks): unlike ``checkpoint_wrapper`` it adds no module level, so names
    stay, and ``fully_shard`` may be applied to the blocks afterwards (the worker's
    order). The RNG state is restored for the recomputation: dropout masks match.
    """
    for block in blocks:
        checkpoint(block)


def _describe(model: nn.Module) -> str:
    inner = getattr(model, "hf", None)
    name = type(model).__name__
    return f"{name} ({type(inner).__name__})" if isinstance(inner, nn.Module) else name
