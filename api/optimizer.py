"""``OffloadedAdamW``: a ``torch.optim.Optimizer`` whose AdamW state lives on state servers."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import ParamsT

from cargohold.checkpoints import read_checkpoint, restore_checkpoint, save_checkpoint
from cargohold.exchange import Exchange
from cargohold.groups import (
    HELD_OPTIONS,
    check_held,
    group_hyper,
    group_layout,
    group_lr,
    group_name,
    held_options,
)
from cargohold.ranks import Shares, share_weights
from cargohold.remote import RemoteSegments
from cargohold.servers import StateServers
from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.core.errors import OptimizerError
from cargohold.services.core.layout import Layout, Segment, scatter_params
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.core.state_precision import STATE_DTYPES, StateDtype
from cargohold.services.core.wire import DTYPE_NAMES

T = TypeVar("T")


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW with its fp32 master weights and moments on state servers, in RAM or on NVMe.

    A drop-in ``torch.optim.Optimizer``: ``step()`` sends every parameter's gradient to
    the servers, which run ``torch.optim.AdamW(fused=True)``'s CPU kernel on their part
    of the state, and copies the updated weights back into the parameters; ``zero_grad``,
    param groups with their own ``lr``, ``betas``, ``eps`` and ``weight_decay``, and
    ``torch.optim.lr_scheduler`` schedulers work as with torch's AdamW. With fp32
    parameters a loop gives the same bits as with ``torch.optim.AdamW(fused=True)`` on CPU.

    Differences, each refused with an error naming the parameter or the group rather than
    silently ignored:

    * ``model``: the module the parameters belong to (their names go into checkpoints);
      every parameter of it that requires grad must be in exactly one group.
    * ``step()`` updates every parameter: each needs a gradient (freeze a parameter by
      leaving it out of the groups, with ``requires_grad=False``).
    * After the first step only ``lr`` may change; ``betas``, ``eps`` and
      ``weight_decay`` are held by the servers. No ``add_param_group`` after construction,
      no ``amsgrad``, no ``maximize``.
    * No clipping inside: call ``torch.nn.utils.clip_grad_norm_`` before ``step()``,
      as with torch's AdamW.
    * Between steps the parameters hold the servers' weights: change them with
      :meth:`load_state_dict`, not in place.
    * Parameters are float32 or bfloat16, one dtype per group (bfloat16 ones are updated
      in fp32 masters on the servers); on any device (gradients and weights go through
      host memory).
    * ``state_dtype``: how the servers store the moments, as the ``optim.state_dtype`` of
      a cargohold run: ``"float32"`` (torch's bits), ``"bfloat16"`` (8 bytes of state per
      parameter) or ``"blockwise8"`` (8-bit blocks, about 6); the master weights stay fp32.
      A state dict saved with one kind loads into an optimizer of another (the moments
      are converted).

    ``params``, ``lr``, ``betas``, ``eps`` and ``weight_decay`` are torch's AdamW's.
    ``servers``: from :func:`~cargohold.start_state_servers` or
    :func:`~cargohold.connect_state_servers`, used by this optimizer alone; each must
    answer within ``connect_timeout_s`` (else the constructor raises, naming it) and
    each call within ``timeout_s``. ``checkpoint_dir``: where :meth:`state_dict` writes
    checkpoints, ``keep_checkpoints`` of which are kept.

    ``process_group``: with several ranks (``torchrun``), each holding the whole model
    with the same gradients (DDP's), every rank builds the optimizer with this group
    and the servers from :func:`~cargohold.share_state_servers`. Each rank then pushes
    and fetches 1/W of the state and receives the rest by broadcast;
    :meth:`state_dict` and :meth:`load_state_dict` are called on every rank, and rank 0
    has the servers write or read the checkpoint.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        model: nn.Module,
        servers: StateServers,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_checkpoints: int = 3,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 30.0,
        process_group: dist.ProcessGroup | None = None,
        state_dtype: StateDtype = "float32",
    ) -> None:
        if state_dtype not in STATE_DTYPES:
            raise OptimizerError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
        self._state_dtype = state_dtype
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._group_of: dict[int, int] = {}
        """id(parameter) -> the group it was placed in, filled as groups are added."""
        self._layout: Layout | None = None
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        for name, param in model.named_parameters():
            if param.requires_grad and id(param) not in self._group_of:
                raise OptimizerError(
                    f"parameter {name!r} of the model is in no param group: add it to one, or set "
                    "requires_grad=False on it (or pass as model the module this optimizer trains)"
                )
        self._params: list[torch.Tensor] = [p for group in self.param_groups for p in group["params"]]
        """In layout order: group by group."""
        self._dtypes = [_group_dtype(i, group, self._names) for i, group in enumerate(self.param_groups)]
        self._group = process_group
        self._shares = Shares(
            ranks=dist.get_world_size(process_group) if process_group is not None else 1,
            rank=dist.get_rank(process_group) if process_group is not None else 0,
        )
        self._layout = group_layout(
            [[(self._names[id(p)], tuple(p.shape)) for p in group["params"]] for group in self.param_groups],
            len(servers.addresses),
            self._shares.ranks,
        )
        self._servers = servers
        self._store = (
            CheckpointDir(Path(checkpoint_dir), keep_last=keep_checkpoints) if checkpoint_dir is not None else None
        )
        self._updates: int | None = None
        """Updates the servers applied; None until they hold the segments."""
        self._held: list[tuple[Any, ...]] = []
        self._exchange = Exchange(self._layout, self._params, self._dtypes)
        self._remote = RemoteSegments(servers, self._shares, timeout_s=timeout_s)
        try:
            self._remote.check_reachable(connect_timeout_s)
        except BaseException:
            self._remote.close()
            raise

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, during construction only; refuses a tensor that is not a parameter
        of the model or is in a group already, and options out of range, naming them."""
        if self._layout is not None:
            raise OptimizerError(
                "add_param_group after construction: OffloadedAdamW places its groups on the state servers "
                "once; build it with every group"
            )
        index = len(self.param_groups)
        group = dict(param_group)
        params = group["params"]
        if not isinstance(params, set):  # torch refuses a set itself, saying why
            group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
            for position, entry in enumerate(group["params"]):
                self._place(index, position, entry[1] if isinstance(entry, tuple) else entry)
        super().add_param_group(group)
        group_hyper(index, self.param_groups[index])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter: push the gradients, fetch the weights.

        Each parameter needs a gradient; the lr of each group is read now (so schedulers
        apply). Returns what ``closure`` (re-evaluating the loss) returned, if given. If
        it fails part-way (a server out of reach), calling it again with the same
        gradients finishes the same update: a server ignores a gradient it applied.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_gradients()
        lrs = [group_lr(i, group) for i, group in enumerate(self.param_groups)]
        updates = self._start()
        self._exchange.gather_grads()
        self._remote.update(
            self._own,
            updates + 1,
            lr_of=lambda segment: lrs[segment.unit],  # a param group's unit has its index
            gradient=self._exchange.gradient,
            weights=self._exchange.weights_of,
        )
        self._updates = updates + 1
        self._share_weights()
        self._exchange.scatter_weights()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Write a checkpoint of the servers' state under ``checkpoint_dir`` and return a
        small dict: ``checkpoint`` (its folder) and ``param_groups`` (each group's options,
        its ``params`` by name). ``torch.save`` it; the folder must stay where it is.

        Before the first step the servers hold no state of this optimizer, as torch's
        AdamW holds none: ``checkpoint`` is None and nothing is written (so a
        ``load_state_dict(state_dict())`` round trip, which accelerate makes when it
        prepares an optimizer, changes nothing)."""
        groups = [
            {
                **{k: v for k, v in group.items() if k not in ("params", "param_names")},
                "params": self._group_names(group),
            }
            for group in self.param_groups
        ]
        if self._updates is None:
            return {"checkpoint": None, "param_groups": groups}
        store = self._store
        if store is None:
            raise OptimizerError(
                "state_dict() writes a checkpoint of the state servers' state: build OffloadedAdamW with checkpoint_dir"
            )
        updates = self._start()
        path = self._on_rank_0(
            lambda: save_checkpoint(
                self._servers,
                self._require_layout(),
                store,
                updates=updates,
                options=[dict(zip(HELD_OPTIONS, held)) for held in self._held],
            )
        )
        return {"checkpoint": str(path.resolve()), "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the groups' options, and the servers' state from
        its checkpoint, onto any number of servers; the parameters are set to its weights.

        Before the first step only (the servers hold no state of this optimizer yet); one
        saved before its first step sets only the options. Every check runs before
        anything changes: another model's state dict is refused,
        naming the parameter or the group that differs.
        """
        if self._updates is not None:
            raise OptimizerError(
                "load_state_dict() must come before the first step(): from then on the state "
                "servers hold this optimizer's state; load into a new OffloadedAdamW with servers of its own"
            )
        if not isinstance(state_dict, Mapping) or not {"checkpoint", "param_groups"} <= state_dict.keys():
            raise OptimizerError(
                "not a state dict of OffloadedAdamW: it needs 'checkpoint' and 'param_groups' (one of "
                "torch.optim.AdamW holds moments per parameter and cannot be loaded)"
            )
        saved = list(state_dict["param_groups"])
        if len(saved) != len(self.param_groups):
            raise OptimizerError(
                f"the state dict has {len(saved)} param groups, this optimizer {len(self.param_groups)}"
            )
        for index, (ours, theirs) in enumerate(zip(self.param_groups, saved)):
            _check_same_params(index, self._group_names(ours), list(theirs["params"]))
            group_hyper(index, {**ours, **theirs})
        layout = self._require_layout()
        checkpoint = state_dict["checkpoint"]
        manifest = read_checkpoint(Path(checkpoint), layout) if checkpoint is not None else None
        for ours, theirs in zip(self.param_groups, saved):
            ours.update({k: v for k, v in theirs.items() if k != "params"})
        if manifest is None:  # saved before its first step: the options are all there is
            return
        path = Path(checkpoint)
        specs = self._specs()
        self._on_rank_0(lambda: restore_checkpoint(self._servers, layout, self._shares, specs, path, manifest))
        self._updates = manifest.updates
        self._remote.fetch(self._own, manifest.updates, self._exchange.weights_of)
        self._share_weights()
        self._exchange.scatter_weights()

    def close(self) -> None:
        """Close the connections to the servers (it does not stop them)."""
        self._remote.close()

    @property
    def _segments(self) -> tuple[Segment, ...]:
        return self._require_layout().segments

    @property
    def _own(self) -> tuple[Segment, ...]:
        """The segments this process pushes and fetches: its rank's (all, alone)."""
        return tuple(s for s in self._segments if self._shares.rank_of(s) == self._shares.rank)

    def _share_weights(self) -> None:
        """With a process group, every rank receives the weights the others fetched."""
        if self._shares.ranks > 1:
            share_weights(self._segments, self._shares, self._exchange.weights_of, self._group)

    def _on_rank_0(self, action: Callable[[], T]) -> T:
        """``action()`` here, or with a process group on its rank 0 only (the one that
        started the servers and so may order checkpoints), its result sent to every rank
        after it ended."""
        if self._shares.ranks == 1:
            return action()
        result: list[object] = [action() if self._shares.rank == 0 else None]
        dist.broadcast_object_list(result, group=self._group, group_src=0)
        return result[0]  # type: ignore[return-value]

    def _start(self) -> int:
        """The update count, registering the segments with the parameters' current values
        first if the servers hold none yet; refuses a group whose held options changed."""
        if self._updates is None:
            specs = self._specs()
            initial = scatter_params(self._require_layout(), [p.detach() for p in self._params])
            own = self._own
            self._remote.register([specs[s.segment_id] for s in own], [self._shares.server(s) for s in own], initial)
            self._updates = 0
        for index, group in enumerate(self.param_groups):
            check_held(index, group, self._held[index])
        return self._updates

    def _specs(self) -> list[SegmentSpec]:
        """Every segment's spec by id, with the groups' options now; they are held from here on."""
        self._held = [held_options(group) for group in self.param_groups]
        hypers = [group_hyper(i, group) for i, group in enumerate(self.param_groups)]
        return [
            SegmentSpec(
                run_id=self._servers.run_id,
                segment_id=s.segment_id,
                start=s.start,
                numel=s.numel,
                fragments=tuple((f.segment_start, f.length) for f in s.fragments),
                grad_dtype=DTYPE_NAMES[self._dtypes[s.unit]],
                hyper=hypers[s.unit],
                state_dtype=self._state_dtype,
            )
            for s in self._segments
        ]

    def _check_gradients(self) -> None:
        missing = [self._names[id(p)] for p in self._params if p.grad is None]
        if missing and len(missing) == len(self._params):
            raise OptimizerError("step() found no gradients: call backward() on the loss before step()")
        if missing:
            others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise OptimizerError(
                f"step() found no gradient for parameter {missing[0]!r}{others}: OffloadedAdamW updates every "
                "parameter of its groups at each step; leave the ones that do not train out of them"
            )
        for param in self._params:
            assert param.grad is not None
            if param.grad.is_sparse:
                raise OptimizerError(
                    f"parameter {self._names[id(param)]!r} has a sparse gradient; AdamW takes dense ones"
                )

    def _place(self, index: int, position: int, param: object) -> None:
        """Note that group ``index`` holds ``param``, refusing a foreign tensor or a second placement."""
        if not isinstance(param, torch.Tensor):
            return  # torch's add_param_group refuses it
        name = self._names.get(id(param))
        if name is None:
            raise OptimizerError(
                f"{group_name(index)}['params'][{position}] (shape {tuple(param.shape)}) is not a parameter "
                "of the model"
            )
        if id(param) in self._group_of:
            first = self._group_of[id(param)]
            where = (
                f"twice in {group_name(index)}" if first == index else f"in {group_name(first)} and {group_name(index)}"
            )
            raise OptimizerError(f"parameter {name!r} is {where}; each parameter belongs to one group")
        self._group_of[id(param)] = index

    def _group_names(self, group: Mapping[str, Any]) -> list[str]:
        return [self._names[id(p)] for p in group["params"]]

    def _require_layout(self) -> Layout:
        assert self._layout is not None, "set at the end of construction"
        return self._layout


def _group_dtype(index: int, group: Mapping[str, Any], names: Mapping[int, str]) -> torch.dtype:
    """The one dtype of a group's parameters, float32 or bfloat16."""
    params = group["params"]
    dtype = params[0].dtype if params else torch.float32
    for param in params:
        if param.dtype not in DTYPE_NAMES:
            raise OptimizerError(
                f"parameter {names[id(param)]!r} is {param.dtype}: OffloadedAdamW takes float32 or bfloat16 parameters"
            )
        if param.dtype != dtype:
            raise OptimizerError(
                f"parameter {names[id(param)]!r} of {group_name(index)} is {param.dtype}, the group's first "
                f"{dtype}: a group's parameters share one dtype"
            )
    return dtype


def _check_same_params(index: int, ours: list[str], theirs: list[str]) -> None:
    """Refuse a saved group that does not hold the same parameters (by name, in any order)."""
    only_ours = sorted(set(ours) - set(theirs), key=ours.index)
    only_theirs = sorted(set(theirs) - set(ours), key=theirs.index)
    if only_ours:
        raise OptimizerError(
            f"{group_name(index)}: parameter {only_ours[0]!r} is not in the state dict's group; it is of another "
            "model or grouped otherwise"
        )
    if only_theirs:
        raise OptimizerError(
            f"{group_name(index)}: the state dict's group has parameter {only_theirs[0]!r}, which this optimizer's "
            "does not; it is of another model or grouped otherwise"
        )
