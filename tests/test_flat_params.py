"""Moving a built model's parameters into the flat buffer: the values, the padding, the
shared storage, the fp32 initial pieces, and the memory peak as the kernel counts it."""

from __future__ import annotations

import textwrap

import pytest
import torch

from cargohold.services.flat_params import move_into_flat
from cargohold.services.layout import layout_for_module
from cargohold.services.models.gpt import GPT, GPTConfig
from system import run_measured

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [0, 1])
def test_parameters_move_into_views_of_the_flat_buffer(dtype: torch.dtype, rank: int) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    layout = layout_for_module(model, num_workers=2, num_servers=2, bucket_elements=10_000)
    originals = [p.detach().clone() for p in model.parameters()]
    reference = torch.zeros(layout.total)
    for slot, value in zip(layout.params, originals):
        reference[slot.offset : slot.offset + slot.numel] = value.reshape(-1)
    pieces = layout.worker_pieces(rank)

    flat, initial = move_into_flat(model, layout, pieces, dtype=dtype, device=torch.device("cpu"))

    assert flat.dtype == dtype and torch.equal(flat, reference.to(dtype)), "values and zero padding"
    assert torch.equal(initial, torch.cat([reference[a:b] for a, b in pieces])), "fp32 initial pieces"
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    for slot, param in zip(layout.params, model.parameters()):
        assert param.data_ptr() == flat[slot.offset :].data_ptr() and param.dtype == dtype
    flat.add_(1)  # training writes the flat buffer: the parameters see it
    assert torch.equal(next(model.parameters()).detach().reshape(-1), flat[: layout.params[0].numel])


def test_a_layout_of_another_model_is_refused() -> None:
    model = GPT(CONFIG)
    other = layout_for_module(torch.nn.Linear(4, 4), num_workers=1, num_servers=1)
    with pytest.raises(ValueError, match="parameters"):
        move_into_flat(model, other, (), dtype=torch.float32, device=torch.device("cpu"))


def test_the_peak_is_one_model_not_two() -> None:
    """A 25M-parameter fp32 model (100 MiB) moved into an fp32 flat buffer: the process's
    peak RSS grows by far less than a second copy of the model (copying it whole first,
    as workers did before, grows it by the whole model)."""
    script = textwrap.dedent("""
        import json, torch
        from cargohold.services.flat_params import move_into_flat
        from cargohold.services.layout import layout_for_module
        from cargohold.services.models.gpt import GPT, GPTConfig
        from system import proc_status, reset_peak_rss

        torch.set_num_threads(1)
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512))
        layout = layout_for_module(model, num_workers=2, num_servers=1)
        base = reset_peak_rss()
        flat, initial = move_into_flat(model, layout, layout.worker_pieces(0), dtype=torch.float32,
                                       device=torch.device("cpu"))
        print(json.dumps({"growth": proc_status("VmHWM") - base, "model": 4 * layout.total,
                          "initial": 4 * initial.numel(), "largest": 4 * max(s.numel for s in layout.params)}))
    """)
    result = run_measured(script, timeout=120)
    assert result["model"] > 90 << 20
    allowed = result["initial"] + 2 * result["largest"] + (8 << 20)
    assert result["growth"] <= allowed, (
        f"peak grew {result['growth'] / 2**20:.1f} MiB moving a {result['model'] / 2**20:.0f} MiB model "
        f"(allowed {allowed / 2**20:.1f} MiB: the initial pieces, two parameters, 8 MiB slack)"
    )
