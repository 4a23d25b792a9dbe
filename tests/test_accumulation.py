"""Gradient accumulation (``data.micro_batches``) on real Ray actors, gRPC and gloo: bitwise
equal to references that accumulate the same micro-batches in the same order (one
process, and FSDP2 + torch.optim.AdamW(fused=True) at the same world size), with one push
of each segment per step whatever the number of micro-batches."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import fsdp_reference_train, reference_train, tiny_config
from test_training_contract import _assert_matches_reference, _layout, _run

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.sections import config_task
from cargohold.services.metrics.names import TRANSPORT_SENT_BYTES

pytestmark = pytest.mark.integration


def _pushed_bytes(session: TrainingSession) -> dict[int, float]:
    """Gradient bytes each worker has pushed so far, by rank (its metrics endpoint)."""
    pushed: dict[int, float] = {}
    for target in session.metrics_targets():
        if target.role != "worker":
            continue
        with urllib.request.urlopen(f"http://{target.address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        pushed[target.index] = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == TRANSPORT_SENT_BYTES and sample.labels["rpc"].startswith("PushGradient")
        )
    return pushed


@pytest.mark.slow  # 41 s; tests/test_step.py runs the same strategies without Ray, and bf16 and chat here
def test_accumulation_matches_references_bitwise_with_one_push_per_step(ray_local) -> None:
    """Three micro-batches a step over two servers, clipping configured (staged pushes):
    weights, moments and losses equal both references'; each worker pushed its range once
    a step, in fp32 (4 bytes an element)."""
    config = tiny_config(steps=10, state_server__num_servers=2, data__micro_batches=3)
    layout, losses, weights, server = _run(config)
    _assert_matches_reference(config, layout, losses, weights, server)
    _assert_matches_reference(config, layout, losses, weights, server, fsdp_reference_train(config, config.steps))
    assert losses[-1] < losses[0] - 0.5, "the loss should fall visibly in 10 steps"

    steps = 3
    with TrainingSession(tiny_config(steps=steps, data__micro_batches=3, worker__shared_memory="off")) as session:
        for _ in range(steps):
            session.step()
        pushed = _pushed_bytes(session)
    ranges = {rank: sum(s.numel for s in layout.segments_of_worker(rank)) for rank in range(2)}
    assert pushed == {rank: steps * 4 * numel for rank, numel in ranges.items()}


def test_accumulation_differs_from_one_micro_batch() -> None:
    """The micro-batches are more data, not the same data cut up: one micro-batch of the
    same batch size trains to other weights (so the test above can fail)."""
    config = tiny_config(steps=2, data__micro_batches=2)
    single = tiny_config(steps=2)
    layout = _layout(config)
    assert not reference_train(config, 2).flat(layout).equal(reference_train(single, 2).flat(layout))


def test_accumulation_in_bf16_matches_fsdp2_bitwise(ray_local) -> None:
    """bf16 compute and wire: the micro-batches' reduced gradients are bf16, their sum fp32
    (FSDP2 casts each to the fp32 parameters' dtype before adding it to ``.grad``), and
    the push carries the fp32 sum."""
    config = tiny_config(
        steps=6,
        state_server__num_servers=2,
        worker__compute_dtype="bfloat16",
        worker__grad_wire_dtype="bfloat16",
        data__micro_batches=2,
    )
    layout, losses, weights, server = _run(config)
    _assert_matches_reference(config, layout, losses, weights, server, fsdp_reference_train(config, config.steps))


@pytest.mark.slow  # the default suite keeps chat weighting (test_training_contract) and accumulation (above) apart
def test_accumulated_chat_loss_is_the_token_mean_bitwise(ray_local, tmp_path) -> None:
    """Chat data with two micro-batches: ranks and micro-batches count different numbers
    of tokens, each weighted by its share of the whole step (Batch.weight over the
    micro-batches), and the run equals both references bitwise."""
    pytest.importorskip("transformers")
    from data_fixtures import make_tokenizer, write_chat

    data = {
        "format": "chat",
        "path": str(write_chat(tmp_path / "chat.jsonl", 200)),
        "tokenizer": str(make_tokenizer(tmp_path / "tokenizer")),
        "cache_dir": str(tmp_path / "cache"),
        "micro_batches": 2,
    }
    config = tiny_config(
        steps=6, model__vocab_size=384, worker__shared_memory="off", **{f"data__{k}": v for k, v in data.items()}
    )
    source = config_task(config).open_data()
    shares = [source.batch(step, rank, micro).weight for step in (1, 2) for rank in range(2) for micro in range(2)]
    assert len(set(shares)) > 1, "ranks and micro-batches count different numbers of tokens"
    layout, losses, weights, server = _run(config)
    _assert_matches_reference(config, layout, losses, weights, server)
    _assert_matches_reference(config, layout, losses, weights, server, fsdp_reference_train(config, config.steps))
