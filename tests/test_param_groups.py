"""Param groups of the CLI's config (``optim.no_decay``, ``optim.param_groups``): which
weight decay and lr multiplier each parameter of the model gets, what a segment's spec
carries to its server, and the refusals, each naming the group and the pattern or the
parameter, before anything starts (``cargohold train`` exits 2). That a run with them
equals torch's AdamW(fused=True) with the same groups, bitwise, is in
tests/test_training_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from reference import tiny_config

from cargohold.cluster import cli
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_layout
from cargohold.services.core.errors import ConfigError
from cargohold.services.core.layout import Layout
from cargohold.services.core.optim import UpdateGroup
from cargohold.services.worker.param_groups import ParamGroups, resolve_param_groups

pytestmark = pytest.mark.timeout(60)


def _resolve(**overrides: object) -> tuple[Layout, ParamGroups]:
    config = tiny_config(**overrides)
    layout = config_layout(config)[2]
    return layout, resolve_param_groups(config.optim, layout.params)


def _by_name(layout: Layout, groups: ParamGroups) -> dict[str, UpdateGroup]:
    return {place.name: groups.groups[g] for place, g in zip(layout.params, groups.of_param)}


def test_without_groups_every_parameter_decays() -> None:
    layout, groups = _resolve()
    assert groups.groups == (UpdateGroup(weight_decay=0.1),)
    assert set(groups.of_param) == {0}


def test_the_usual_rule_exempts_biases_and_norms_only() -> None:
    layout, groups = _resolve(optim__no_decay="biases_and_norms")
    by_name = _by_name(layout, groups)
    assert by_name["blocks.0.attn.c_attn.bias"] == by_name["ln_f.weight"] == UpdateGroup(weight_decay=0.0)
    assert by_name["wte.weight"] == by_name["blocks.1.mlp.c_fc.weight"] == UpdateGroup(weight_decay=0.1)
    assert len(groups.groups) == 2


def test_groups_set_lr_multipliers_and_their_own_decay() -> None:
    layout, groups = _resolve(
        optim__no_decay="biases_and_norms",
        optim__param_groups=[
            {"name": "emb", "params": ["wte.*", "wpe.*"], "lr_mult": 0.5},
            {"name": "attn", "params": ["*.attn.*"], "weight_decay": 0.2},
        ],
    )
    by_name = _by_name(layout, groups)
    assert by_name["wte.weight"] == by_name["wpe.weight"] == UpdateGroup(weight_decay=0.1, lr_scale=0.5)
    # weight_decay set: it holds for the group's biases too; unset, the rule decides.
    assert by_name["blocks.1.attn.c_proj.bias"] == UpdateGroup(weight_decay=0.2)
    assert by_name["blocks.1.mlp.c_proj.bias"] == UpdateGroup(weight_decay=0.0)
    assert by_name["lm_head.weight"] == UpdateGroup(weight_decay=0.1)


def test_a_segment_carries_the_groups_of_its_fragments() -> None:
    layout, groups = _resolve(optim__no_decay="biases_and_norms", state_server__num_servers=2)
    for segment in layout.segments:
        used, fragment_group = groups.of_segment(segment)
        assert len(fragment_group) == len(segment.fragments)
        for fragment, index in zip(segment.fragments, fragment_group):
            assert used[index] == groups.groups[groups.of_param[fragment.param_index]]
    assert any(len(groups.of_segment(s)[0]) == 2 for s in layout.segments)


@pytest.mark.parametrize(
    "param_groups, named",
    [
        ([{"name": "emb", "params": ["tok_emb.*"]}], ["'emb'", "'tok_emb.*'", "matches no parameter"]),
        (
            [{"name": "a", "params": ["blocks.0.*"]}, {"name": "b", "params": ["*.bias"]}],
            ["'blocks.0.ln_1.bias'", "'a'", "'b'", "'blocks.0.*'", "'*.bias'"],
        ),
    ],
    ids=["pattern-matching-nothing", "parameter-in-two-groups"],
)
def test_bad_patterns_are_refused_naming_group_pattern_and_parameter(param_groups: list, named: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        _resolve(optim__param_groups=param_groups)
    for text in named:
        assert text in str(error.value)


@pytest.mark.parametrize(
    "groups, key",
    [
        ([{"name": "x", "params": []}], "'x'"),
        ([{"name": "x", "params": ["*"], "lr_mult": -1.0}], "lr_mult"),
        ([{"name": "x", "params": ["*"], "weight_decay": -0.1}], "weight_decay"),
        ([{"name": "x", "params": ["w*"]}, {"name": "x", "params": ["l*"]}], "two groups are named 'x'"),
        ([{"params": ["*"]}], "name"),
    ],
)
def test_bad_groups_are_refused_by_the_schema(groups: list, key: str) -> None:
    with pytest.raises(ConfigError, match="optim.param_groups") as error:
        tiny_config(optim__param_groups=groups)
    assert key in str(error.value)


def test_cargohold_train_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(config: TrainConfig) -> int:
        raise AssertionError("the run reached training")

    monkeypatch.setattr(cli, "_train", refuse)
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}\n"
        "optim:\n"
        "  param_groups:\n"
        "    - {name: emb, params: ['wte.*']}\n"
        "    - {name: head, params: ['lm_head.*', 'wte.*']}\n"
    )
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'wte.weight'" in err and "'emb'" in err and "'head'" in err
