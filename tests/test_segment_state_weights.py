"""SegmentState weight reads: the current step's weights in either wire dtype as copies,
other steps and dtypes refused, and weight buffers reused only once handed back."""

from __future__ import annotations

import pytest
import torch
from segment_states import NUMEL, fresh_state, initial_weights, step_gradient

from cargohold.services.core.errors import InvalidTensorError, UpdateMismatchError

pytestmark = pytest.mark.timeout(60)


def test_weights_of_the_current_step_in_both_wire_dtypes() -> None:
    state = fresh_state()
    initial = initial_weights(state.spec)
    assert torch.equal(state.weights(0, "float32"), initial)
    for step in (1, 2):
        state.apply_gradient(step, step_gradient(step), global_norm=0.5, lr=1e-2)
    master = state.snapshot()["master"]
    fp32 = state.weights(2, "float32")
    bf16 = state.weights(2, "bfloat16")
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert fp32.shape == bf16.shape == (NUMEL,)
    assert torch.equal(fp32, master)
    assert torch.equal(bf16, master.to(torch.bfloat16))
    # Copies: writing to them leaves the segment alone.
    fp32.fill_(0.0)
    bf16.fill_(0.0)
    assert torch.equal(state.snapshot()["master"], master)


@pytest.mark.parametrize("asked", [0, 1, 3, -1])
def test_weights_of_another_step_raise_step_mismatch(asked: int) -> None:
    state = fresh_state()
    state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    state.apply_gradient(2, step_gradient(2), global_norm=0.5, lr=1e-2)
    with pytest.raises(UpdateMismatchError, match=rf"holds the weights of update 2, not of update {asked}$"):
        state.weights(asked, "float32")


def test_weights_in_an_unknown_dtype_raise_invalid_tensor() -> None:
    state = fresh_state()
    with pytest.raises(
        InvalidTensorError, match=r"weight dtype 'float64' is not one of \['bfloat16', 'float16', 'float32'\]"
    ):
        state.weights(0, "float64")


def test_weights_buffers_are_reused_only_once_handed_back() -> None:
    state = fresh_state()
    state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    first = state.weights(1, "bfloat16")  # read (nothing prepared)
    kept = first.clone()
    state.apply_gradient(2, step_gradient(2), global_norm=0.5, lr=1e-2, prepare="bfloat16")
    assert torch.equal(first, kept)  # not handed back: never written again
    second = state.weights(2, "bfloat16")  # the weights the update prepared
    assert second.data_ptr() != first.data_ptr()
    state.recycle(second)
    state.apply_gradient(3, step_gradient(3), global_norm=0.5, lr=1e-2, prepare="bfloat16")
    third = state.weights(3, "bfloat16")
    assert third.data_ptr() == second.data_ptr()  # the update prepared into the recycled buffer
    assert torch.equal(third, state.snapshot()["master"].to(torch.bfloat16))
    again = state.weights(3, "bfloat16")  # a second fetch of the step while the first holds it
    assert again.data_ptr() != third.data_ptr() and torch.equal(again, third)
    state.recycle(third)
    state.recycle(again)  # one spare at most; the other is freed
    in_fp32 = state.weights(3, "float32")  # a spare of another dtype is not used
    assert torch.equal(in_fp32, state.snapshot()["master"])
    reread = state.weights(3, "bfloat16")
    assert reread.data_ptr() == third.data_ptr() and torch.equal(reread, again)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_update_writes_its_weights_into_the_callers_destination(dtype: str) -> None:
    """``weights_out``: the update writes the new weights straight into the caller's
    tensor (a worker's shared memory), keeps nothing for a fetch, and a repeat of the
    update (a retry after a lost reply) writes them again."""
    wire = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state, reference = fresh_state(), fresh_state()
    out = torch.full((NUMEL,), float("nan"), dtype=wire)
    state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2, prepare=dtype, weights_out=out)
    reference.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    assert torch.equal(out, reference.weights(1, dtype))
    assert state._prepared is None and state._buffers.taken == 0
    out.fill_(float("nan"))
    repeat = state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2, prepare=dtype, weights_out=out)
    assert not repeat.applied and torch.equal(out, reference.weights(1, dtype))
    state.stage_gradient(2, step_gradient(2))
    reference.apply_gradient(2, step_gradient(2), global_norm=0.5, lr=1e-2)
    for _ in range(2):  # the commit, then its repeat
        out.fill_(float("nan"))
        state.commit(2, global_norm=0.5, lr=1e-2, prepare=dtype, weights_out=out)
        assert torch.equal(out, reference.weights(2, dtype))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights_out": torch.zeros(NUMEL)}, r"destination needs their dtype \(prepare_dtype\)"),
        ({"prepare": "bfloat16", "weights_out": torch.zeros(NUMEL)}, "weights destination must be torch.bfloat16"),
        ({"prepare": "float32", "weights_out": torch.zeros(NUMEL - 1)}, f"weights destination must have {NUMEL}"),
    ],
)
def test_a_bad_weights_destination_is_refused_before_the_update(kwargs: dict, message: str) -> None:
    state = fresh_state()
    before = state.snapshot()["master"]
    with pytest.raises(InvalidTensorError, match=message):
        state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2, **kwargs)
    assert state.updates == 0 and torch.equal(state.snapshot()["master"], before)
