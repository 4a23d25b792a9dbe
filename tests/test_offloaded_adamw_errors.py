"""Bad input to OffloadedAdamW: each case is refused with an error naming the parameter,
the group or the server, before any update: parameters missing from the groups or in two
of them, a step without gradients, options the servers cannot take or change, a state
dict of another model, servers out of reach or of another run."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from own_loops import LR, TinyMLP, assert_same_bits, local_servers, offloaded, param_groups, train
from torch import nn

from cargohold import OffloadedAdamW, connect_state_servers
from cargohold.services.core.errors import CheckpointError, OptimizerError, TransportError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def servers():
    with local_servers(1) as started:
        yield started


def test_a_parameter_missing_from_the_groups_is_named(servers) -> None:
    model = TinyMLP()
    with pytest.raises(OptimizerError, match=r"parameter 'fc2.bias' of the model is in no param group"):
        OffloadedAdamW([model.fc1.weight, model.fc1.bias, model.fc2.weight], model=model, servers=servers)
    model.fc2.bias.requires_grad_(False)  # frozen: it may stay out
    OffloadedAdamW([model.fc1.weight, model.fc1.bias, model.fc2.weight], model=model, servers=servers).close()


def test_a_parameter_in_two_groups_is_named_with_both(servers) -> None:
    model = TinyMLP()
    groups = [{"params": list(model.parameters())}, {"params": [model.fc2.weight], "lr": 1.0}]
    with pytest.raises(OptimizerError, match=r"'fc2.weight' is in param_groups\[0\] and param_groups\[1\]"):
        OffloadedAdamW(groups, model=model, servers=servers)
    with pytest.raises(OptimizerError, match=r"'fc1.bias' is twice in param_groups\[0\]"):
        OffloadedAdamW([*model.parameters(), model.fc1.bias], model=model, servers=servers)


def test_a_tensor_of_another_model_is_named_by_position(servers) -> None:
    model = TinyMLP()
    with pytest.raises(OptimizerError, match=r"param_groups\[0\]\['params'\]\[4\] \(shape \(3,\)\) is not a parameter"):
        OffloadedAdamW([*model.parameters(), nn.Parameter(torch.zeros(3))], model=model, servers=servers)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("betas", (0.9, 1.0), r"param_groups\[1\]: betas must be two numbers in \[0, 1\)"),
        ("eps", 0.0, r"param_groups\[1\]: eps must be > 0"),
        ("weight_decay", -0.1, r"param_groups\[1\]: weight_decay must be >= 0"),
        ("amsgrad", True, r"param_groups\[1\]: amsgrad=True is not supported"),
    ],
)
def test_group_options_out_of_range_name_the_group(servers, option: str, value: object, message: str) -> None:
    model = TinyMLP()
    groups = param_groups(model)
    groups[1][option] = value
    with pytest.raises(OptimizerError, match=message):
        OffloadedAdamW(groups, model=model, servers=servers)


def test_a_step_without_gradients_changes_nothing(servers) -> None:
    model, untouched = TinyMLP(), TinyMLP()
    optimizer = offloaded(model, servers)
    with pytest.raises(OptimizerError, match=r"no gradients: call backward\(\) on the loss before step\(\)"):
        optimizer.step()
    model(torch.randn(2, 13)).sum().backward()
    model.fc1.bias.grad = None
    with pytest.raises(OptimizerError, match=r"no gradient for parameter 'fc1.bias'"):
        optimizer.step()
    assert_same_bits(model, untouched)
    assert servers.owner is not None and servers.owner.on_each("snapshot", [(servers.run_id,)]) == [{}]
    optimizer.close()


def test_held_options_may_not_change_after_the_first_step(servers) -> None:
    model = TinyMLP()
    optimizer = offloaded(model, servers)
    train(model, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer), range(1))
    optimizer.param_groups[1]["betas"] = (0.8, 0.999)
    model(torch.randn(2, 13)).sum().backward()
    with pytest.raises(OptimizerError, match=r"param_groups\[1\]: betas changed from \(0.9, 0.999\) to \(0.8, 0.999\)"):
        optimizer.step()
    with pytest.raises(OptimizerError, match="add_param_group after construction"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    optimizer.close()


def _saved(tmp_path: Path, model: nn.Module, groups: list[dict]) -> dict:
    """A state dict of ``model`` after one step (its checkpoint holds the servers' state)."""
    with local_servers(1) as servers:
        optimizer = OffloadedAdamW(groups, lr=LR, model=model, servers=servers, checkpoint_dir=tmp_path)
        first = next(model.parameters())
        model(torch.randn(2, first.shape[1])).sum().backward()
        optimizer.step()
        state = optimizer.state_dict()
        optimizer.close()
    assert state["checkpoint"] is not None
    return state


def test_a_state_dict_of_another_model_is_refused_naming_the_parameter(servers, tmp_path: Path) -> None:
    model = TinyMLP()
    optimizer = offloaded(model, servers)
    wider = nn.Sequential()
    wider.fc1, wider.fc2 = nn.Linear(13, 77), nn.Linear(77, 6)
    with pytest.raises(CheckpointError, match=r"parameter 'fc2.weight' has shape \(6, 77\) in the checkpoint"):
        optimizer.load_state_dict(_saved(tmp_path / "wider", wider, param_groups(wider)))
    renamed = nn.Sequential()
    renamed.fc1, renamed.out = nn.Linear(13, 77), nn.Linear(77, 5)
    with pytest.raises(OptimizerError, match=r"param_groups\[0\]: parameter 'fc2.weight' is not in the state dict's"):
        optimizer.load_state_dict(_saved(tmp_path / "renamed", renamed, param_groups(renamed)))
    with pytest.raises(OptimizerError, match="the state dict has 1 param groups, this optimizer 2"):
        other = TinyMLP()
        optimizer.load_state_dict(_saved(tmp_path / "one", other, [{"params": list(other.parameters())}]))
    with pytest.raises(OptimizerError, match="not a state dict of OffloadedAdamW"):
        optimizer.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    assert_same_bits(model, TinyMLP())  # nothing was loaded
    optimizer.close()


def test_a_state_dict_before_the_first_step_holds_only_the_options(servers) -> None:
    """As torch's AdamW's: nothing is written, no checkpoint_dir is needed, and loading it
    back (accelerate's round trip when it prepares an optimizer) sets only the options."""
    model = TinyMLP()
    optimizer = offloaded(model, servers)
    state = optimizer.state_dict()
    assert state["checkpoint"] is None
    state["param_groups"][0]["lr"] = 0.5
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert_same_bits(model, TinyMLP())
    optimizer.close()


def test_a_state_dict_loads_before_the_first_step_only(servers, tmp_path: Path) -> None:
    model = TinyMLP()
    state = _saved(tmp_path, model, param_groups(model))
    optimizer = offloaded(model, servers)
    train(model, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer), range(1))
    with pytest.raises(OptimizerError, match=r"load_state_dict\(\) must come before the first step\(\)"):
        optimizer.load_state_dict(state)
    with pytest.raises(OptimizerError, match="build OffloadedAdamW with checkpoint_dir"):
        optimizer.state_dict()
    optimizer.close()


def test_servers_out_of_reach_are_named_before_the_first_step() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    model = TinyMLP()
    servers = connect_state_servers([address], run_id="nobody")
    with pytest.raises(TransportError, match=rf"state server 0 at {address} cannot be used: .*not reachable"):
        OffloadedAdamW(model.parameters(), model=model, servers=servers, connect_timeout_s=0.5)


def test_servers_of_another_run_or_token_are_named(servers) -> None:
    model = TinyMLP()
    for run_id, token, why in [
        ("another-run", servers.token, "serves run .* not 'another-run'"),
        (servers.run_id, "wrong", "UNAUTHENTICATED"),
    ]:
        found = connect_state_servers(servers.addresses, run_id=run_id, auth_token=token)
        with pytest.raises(TransportError, match=rf"state server 0 at {servers.addresses[0]} cannot be used: .*{why}"):
            OffloadedAdamW(model.parameters(), model=model, servers=found)


def test_servers_found_by_address_train_but_cannot_checkpoint(servers, tmp_path: Path) -> None:
    model = TinyMLP()
    found = connect_state_servers(servers.addresses, run_id=servers.run_id, auth_token=servers.token)
    optimizer = OffloadedAdamW(param_groups(model), lr=LR, model=model, servers=found, checkpoint_dir=tmp_path)
    train(model, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer), range(1))
    with pytest.raises(CheckpointError, match="were found by address: only the process that started them"):
        optimizer.state_dict()
    optimizer.close()
    second = OffloadedAdamW(param_groups(model), lr=LR, model=model, servers=found)
    model(torch.randn(2, 13)).sum().backward()
    with pytest.raises(OptimizerError, match="already holds segment 0 .* needs state servers of its own"):
        second.step()
    second.close()
