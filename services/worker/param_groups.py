"""Which weight decay and learning-rate multiplier each parameter is updated with, from
``optim.weight_decay``, ``optim.no_decay`` and ``optim.param_groups`` and the model's
parameter names; and how a segment tells its state server.

Every parameter gets one (weight decay, lr multiplier) pair; parameters with the same pair
form one **param group**, updated by one call of the fused kernel over their fragments, as
``torch.optim.AdamW`` makes one call per param group. The fused kernel is elementwise per
tensor, so which parameters share a call changes no bit: a run equals torch's AdamW(fused)
with these groups (``param_groups[g]["lr"] = lr * lr_mult``). Resolved from the config and
the layout's names alone, the same in the launcher, every worker and the tests; a bad
pattern is a :class:`ConfigError` before anything starts.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from cargohold.cluster.schema.optim import OptimConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.core.layout import ChunkPlace, Layout, Segment
from cargohold.services.core.optim import UpdateGroup


@dataclass(frozen=True, slots=True)
class ParamGroups:
    """The param groups of a layout's parameters."""

    groups: tuple[UpdateGroup, ...]
    """The distinct (weight decay, lr multiplier) pairs, in the order of their first parameter."""
    of_param: tuple[int, ...]
    """Each layout parameter's index in ``groups``."""

    def of_segment(self, segment: Segment) -> tuple[tuple[UpdateGroup, ...], tuple[int, ...]]:
        """What a segment's spec carries: the groups its fragments use and each
        fragment's index among them."""
        used: list[int] = []
        for fragment in segment.fragments:
            group = self.of_param[fragment.param_index]
            if group not in used:
                used.append(group)
        return (
            tuple(self.groups[g] for g in used),
            tuple(used.index(self.of_param[f.param_index]) for f in segment.fragments),
        )

    def members(self, group: int, layout: Layout) -> list[str]:
        """The names of a group's parameters, in layout order."""
        return [place.name for place, g in zip(layout.params, self.of_param) if g == group]


def resolve_param_groups(optim: OptimConfig, params: Sequence[ChunkPlace]) -> ParamGroups:
    """Each parameter's group; refuses, naming the group and the pattern or parameter, a
    pattern that matches no parameter and a parameter that two groups match."""
    names = [place.name for place in params]
    claimed: dict[str, tuple[str, str]] = {}
    """Parameter name -> (group name, pattern) of the group that matched it."""
    for group in optim.param_groups:
        for pattern in group.params:
            matched = fnmatch.filter(names, pattern)
            if not matched:
                raise ConfigError(
                    f"optim.param_groups {group.name!r}: pattern {pattern!r} matches no parameter of the model "
                    f"(its {len(names)} parameters are named like {', '.join(map(repr, names[:4]))})"
                )
            for name in matched:
                first = claimed.setdefault(name, (group.name, pattern))
                if first[0] != group.name:
                    raise ConfigError(
                        f"parameter {name!r} is matched by optim.param_groups {first[0]!r} (pattern {first[1]!r}) "
                        f"and {group.name!r} (pattern {pattern!r}); a parameter belongs to one group: narrow a pattern"
                    )
    by_name = {group.name: group for group in optim.param_groups}
    pairs: list[UpdateGroup] = []
    of_param = []
    for place in params:
        member = by_name[claimed[place.name][0]] if place.name in claimed else None
        decay = member.weight_decay if member is not None else None
        if decay is None:
            decay = 0.0 if optim.no_decay == "biases_and_norms" and len(place.shape) < 2 else optim.weight_decay
        pair = UpdateGroup(weight_decay=decay, lr_scale=member.lr_mult if member is not None else 1.0)
        if pair not in pairs:
            pairs.append(pair)
        of_param.append(pairs.index(pair))
    return ParamGroups(groups=tuple(pairs), of_param=tuple(of_param))
