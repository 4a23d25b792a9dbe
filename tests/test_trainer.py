"""``cargohold.Trainer`` on a user's own model, loss and data (tests/user_models.py): a
run on real Ray with 2 FSDP2 workers and 2 state servers equals, bitwise, the same model,
loss and batches under plain torch.optim.AdamW(fused=True) (the gradients of the ranks
averaged, the micro-batches' summed in fp32); each kind of data; the callbacks; a resumed
run equal to an uninterrupted one; and the refusals before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import torch
import user_models
from reference import tiny_config
from safetensors.torch import load_file
from user_models import Regressor, Stream, batch_function, items, regression_loss

import cargohold
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_layout
from cargohold.services.core.errors import ConfigError, TrainingError
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.user_data import MapStyleBatches, open_user_data
from cargohold.user_task import UserTask, batch_shape_of

pytestmark = pytest.mark.timeout(300)

ray.cloudpickle.register_pickle_by_value(user_models)  # as Ray ships a script's own classes


def _config(tmp_path: Path, **overrides: object) -> TrainConfig:
    defaults: dict[str, object] = {
        "steps": 4,
        "data__batch_size": 4,
        "state_server__num_servers": 2,
        "optim__no_decay": "biases_and_norms",
        "export_dir": str(tmp_path / "export"),
    }
    return tiny_config(**{**defaults, **overrides})


def _reference(config: TrainConfig, data: object) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same model, loss and batches on one process under AdamW(fused=True), with the
    workers' torch threads (a reduction's order depends on them)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(config.worker.torch_threads)
    try:
        return _reference_run(config, data)
    finally:
        torch.set_num_threads(previous)


def _reference_run(config: TrainConfig, data: object) -> tuple[dict[str, torch.Tensor], list[float]]:
    task = UserTask(config, Regressor, regression_loss, data)
    layout = config_layout(config, task)[2]
    groups = resolve_param_groups(config.optim, layout.params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Regressor()
    params = dict(model.named_parameters())
    o = config.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": [params[n] for n in groups.members(i, layout)], "weight_decay": g.weight_decay}
            for i, g in enumerate(groups.groups)
        ],
        lr=o.lr,
        betas=(o.betas[0], o.betas[1]),
        eps=o.eps,
        fused=True,
    )
    source = open_user_data(data, batch_shape_of(config), seed=config.data.seed)
    world, micros = config.worker.num_workers, config.data.micro_batches
    losses = []
    for step in range(1, config.steps + 1):
        accumulated: list[torch.Tensor] | None = None
        step_loss = 0.0
        for micro in range(micros):
            summed: list[torch.Tensor] | None = None
            for rank in range(world):
                model.zero_grad(set_to_none=True)
                loss = regression_loss(model, source.batch(step, rank, micro).data)
                if micros > 1:
                    loss = loss * (1.0 / micros)
                loss.backward()
                step_loss += float(loss.detach())
                grads = [p.grad.clone() for p in model.parameters()]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            assert summed is not None
            reduced = [g / world for g in summed]
            accumulated = reduced if accumulated is None else [a + r for a, r in zip(accumulated, reduced)]
        assert accumulated is not None
        for p, g in zip(model.parameters(), accumulated):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), o.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = o.lr_at(step, config.steps)
        optimizer.step()
        losses.append(step_loss / world)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _exported(config: TrainConfig) -> dict[str, torch.Tensor]:
    assert config.export_dir is not None
    return load_file(str(Path(config.export_dir) / "model.safetensors"))


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# Before the tests that start Ray (ray_local keeps it running for the rest of the module).
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"loss_fn": None}, "model_fn, loss_fn and data go together; loss_fn missing"),
        ({"model_fn": lambda: "not a module"}, "model_fn must return a torch.nn.Module, got str"),
        ({"blocks": ["layers.9"]}, "blocks: the model has no submodule 'layers.9'"),
        ({"data": items(6)}, "the dataset holds 6 items, fewer than one step's global batch"),
        ({"data": iter(items())}, "data is an iterator"),
        ({"data": 42}, "data must be a map-style dataset"),
        ({"eval_data": items(4)}, "eval_data holds 4 items, fewer than one eval batch"),
        ({"eval_every_steps": 2}, "eval_every_steps is set but there is no eval_data"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path, arguments: dict, message: str) -> None:
    given = {"model_fn": Regressor, "loss_fn": regression_loss, "data": items(), **arguments}
    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match=message):
        cargohold.Trainer(config=_config(tmp_path), **given).fit()
    assert not ray.is_initialized()


def test_a_map_style_dataset_trains_bitwise_with_callbacks_checkpoints_and_validation(
    ray_local, tmp_path: Path
) -> None:
    config = _config(tmp_path, checkpoint__dir=str(tmp_path / "ckpt"), checkpoint__every_steps=2)
    dataset, held_out = items(), items(32, seed=1)
    seen: dict[str, list] = {"step": [], "eval": [], "checkpoint": []}
    result = cargohold.Trainer(
        Regressor,
        regression_loss,
        dataset,
        config,
        eval_data=held_out,
        eval_every_steps=2,
        on_step=lambda r: seen["step"].append(r.step),
        on_eval=lambda r: seen["eval"].append((r.step, r.loss)),
        on_checkpoint=lambda path: seen["checkpoint"].append(path),
    ).fit()
    masters, losses = _reference(config, dataset)
    _assert_bitwise(_exported(config), masters)
    assert result.losses == losses
    assert seen["step"] == [1, 2, 3, 4]
    assert [step for step, _ in seen["eval"]] == [2, 4]
    assert seen["checkpoint"] == result.checkpoints and [p.name for p in seen["checkpoint"]] == [
        "step-0000000002",
        "step-0000000004",
    ]
    model = Regressor()  # the export loads into the user's own model
    model.load_state_dict(_exported(config), strict=False)
    with torch.no_grad():  # 8 batches of 4 items: the mean of their means is the mean over the 32
        final = regression_loss(model, torch.utils.data.default_collate(held_out)).item()
    assert seen["eval"][-1][1] == pytest.approx(final, rel=1e-5)


@pytest.mark.slow  # 43 s; resume through the launcher is bitwise in tests/test_recovery.py
def test_a_resumed_run_equals_an_uninterrupted_one(ray_local, tmp_path: Path) -> None:
    dataset = items()
    whole = _config(tmp_path / "whole")
    cargohold.Trainer(Regressor, regression_loss, dataset, whole).fit()
    first = _config(tmp_path / "first", steps=2, checkpoint__dir=str(tmp_path / "ckpt"))
    cargohold.Trainer(Regressor, regression_loss, dataset, first).fit()
    resumed = _config(tmp_path / "resumed", checkpoint__dir=str(tmp_path / "ckpt"), checkpoint__resume="latest")
    result = cargohold.Trainer(Regressor, regression_loss, dataset, resumed).fit()
    assert result.first_step == 2 and len(result.losses) == 2
    _assert_bitwise(_exported(resumed), _exported(whole))


@pytest.mark.parametrize(
    "kind", ["iterable", pytest.param("function", marks=pytest.mark.slow)]
)  # one in the default run
def test_an_iterable_dataset_or_a_batch_function_trains_bitwise_with_accumulation(
    ray_local, tmp_path: Path, kind: str
) -> None:
    config = _config(tmp_path, data__micro_batches=2, worker__num_workers=2)
    data = Stream(200) if kind == "iterable" else batch_function
    result = cargohold.Trainer(
        Regressor, regression_loss, data, config, blocks=["layers.0", "layers.1", "layers.2"]
    ).fit()
    masters, losses = _reference(config, data)
    _assert_bitwise(_exported(config), masters)
    assert result.losses == pytest.approx(losses, rel=1e-6)


def test_a_loss_that_is_not_a_scalar_stops_the_run_naming_the_step(ray_local, tmp_path: Path) -> None:
    config = _config(tmp_path, worker__num_workers=1, state_server__num_servers=1)

    def per_item_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (model(batch["x"]) - batch["y"]).pow(2).mean(dim=1)

    with pytest.raises(TrainingError, match="step 1: the loss function must return a floating-point scalar tensor"):
        cargohold.Trainer(Regressor, per_item_loss, items(), config).fit()


def test_map_style_batches_split_each_epoch_among_ranks_and_steps_without_overlap(tmp_path: Path) -> None:
    config = _config(tmp_path, data__micro_batches=2)
    dataset = [{"i": torch.tensor(i)} for i in range(48)]  # 3 steps of 16 rows make an epoch
    source = MapStyleBatches(dataset, batch_shape_of(config), seed=3, collate=torch.utils.data.default_collate)
    epoch = [int(i) for s in (1, 2, 3) for m in (0, 1) for r in (0, 1) for i in source.batch(s, r, m).data["i"]]
    assert sorted(epoch) == list(range(48))
    again = MapStyleBatches(dataset, batch_shape_of(config), seed=3, collate=torch.utils.data.default_collate)
    assert torch.equal(again.batch(5, 1, 1).data["i"], source.batch(5, 1, 1).data["i"])  # a pure function of step


def test_an_iterable_dataset_gives_each_rank_its_own_items() -> None:
    config = tiny_config(data__batch_size=4)
    stream = [{"i": torch.tensor(i)} for i in range(40)]

    class Items(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(stream)

    source = open_user_data(Items(), batch_shape_of(config), seed=0)
    got = {(s, r): source.batch(s, r).data["i"].tolist() for s in (1, 2) for r in (0, 1)}
    assert got[(1, 0)] == [0, 1, 2, 3] and got[(1, 1)] == [4, 5, 6, 7] and got[(2, 1)] == [12, 13, 14, 15]
    assert source.batch(1, 0).data["i"].tolist() == [0, 1, 2, 3]  # read again from the start
    with pytest.raises(TrainingError, match="ended after 40 items; step 6 needs more"):
        source.batch(6, 0)


def test_the_trainer_example_of_the_docs_runs_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    code = next((c[1] for c in re.finditer(r"```python\n(.*?)```", doc, re.S) if "cargohold.Trainer(" in c[1]), None)
    assert code is not None, "docs/api.md has no Trainer example"
    namespace: dict = {"__name__": "__main__"}  # its classes travel to the workers by value, as a script's
    exec(compile(code.replace("/tmp/", f"{tmp_path}/"), "docs/api.md", "exec"), namespace)
    result = namespace["result"]
    assert len(result.losses) == 20 and result.evals[-1].loss < result.evals[0].loss < result.losses[0], result.evals
    assert [e.step for e in result.evals] == [10, 20]
    assert capsys.readouterr().out.count(f"{tmp_path}/own/checkpoints/step-") == 2  # on_checkpoint=print
    assert (tmp_path / "own" / "model" / "model.safetensors").is_file()
