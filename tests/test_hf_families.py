"""Decoder-only transformers families train bitwise against the reference (issue 14).

Each family's tiny config is written to a temporary folder (nothing is downloaded) and
trained for a few steps on 2 FSDP2 workers; the losses and the fp32 masters must equal
single-process torch.optim.AdamW(fused=True)'s bitwise (tests/reference.py). Llama and
GPT-2 have their own tests in tests/test_hf_models.py. Each family picks a shape the
others do not cover.

- The default run trains every family (FAMILIES and SLOW_FAMILIES) through the real
  worker step without Ray (test_families_train_bitwise_without_ray: one spawn of 2 ranks
  over gloo, the state servers' registry and update in-process, as tests/test_step.py;
  the moments and the workers' weights compared too), and one family, Mixtral (experts as
  3-D parameters), through real Ray actors and a state server
  (test_family_trains_bitwise).
- The ``slow`` run (``pytest -m slow tests/test_hf_families.py``) trains the other
  families through Ray too.

docs/models.md lists the results and the families that do not fit, and why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from reference import reference_train, tiny_config  # noqa: E402
from step_runs import assert_matches_reference, gloo_group, run_ranks, train_in_process  # noqa: E402

from cargohold.cluster.sections import config_layout, model_spec  # noqa: E402
from cargohold.services.core.errors import ConfigError  # noqa: E402
from cargohold.services.models.build import buffer_values, build_model, parameter_values  # noqa: E402

T = transformers
STEPS = 3
SHAPE = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=64,
)
GQA = dict(SHAPE, num_key_value_heads=1)

FAMILIES: dict[str, Callable[[], object]] = {
    "qwen3": lambda: T.Qwen3Config(**GQA, head_dim=16),  # RMSNorm on queries and keys
    "gemma2": lambda: T.Gemma2Config(**GQA, head_dim=16),  # logit soft-capping, sliding window, tied, scaled embedding
    "phi": lambda: T.PhiConfig(**SHAPE),  # partial rotary, LayerNorm, biases, parallel attention and MLP
    "opt": lambda: T.OPTConfig(**SHAPE, ffn_dim=64, word_embed_proj_dim=32),  # learned positions with an offset
    "mixtral": lambda: T.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2),  # experts as 3-D params
    "bloom": lambda: T.BloomConfig(vocab_size=320, hidden_size=32, n_layer=2, n_head=2),  # ALiBi, no position limit
}
SLOW_FAMILIES: dict[str, Callable[[], object]] = {
    "falcon": lambda: T.FalconConfig(**{k: v for k, v in SHAPE.items() if k != "intermediate_size"}),  # multi-query
    "gpt_neox": lambda: T.GPTNeoXConfig(**SHAPE),  # fused QKV, parallel residual
    "qwen2": lambda: T.Qwen2Config(**GQA),
    "mistral": lambda: T.MistralConfig(**GQA),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **GQA, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "gemma": lambda: T.GemmaConfig(**GQA, head_dim=16),
    "gemma3_text": lambda: T.Gemma3TextConfig(**GQA, head_dim=16),
    "phi3": lambda: T.Phi3Config(**SHAPE, pad_token_id=0),
    "gptj": lambda: T.GPTJConfig(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2, rotary_dim=8),
    "stablelm": lambda: T.StableLmConfig(**GQA),
    "olmo": lambda: T.OlmoConfig(**GQA),
    "olmo2": lambda: T.Olmo2Config(**GQA),
    "granite": lambda: T.GraniteConfig(**GQA),
    "cohere": lambda: T.CohereConfig(**GQA),
    "starcoder2": lambda: T.Starcoder2Config(**GQA),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2),
}
NO_CONTEXT = {"bloom"}
"""Families whose config states no context length: data.block_size is set instead."""

PARAMS = [
    *(pytest.param(name, make, id=name) for name, make in FAMILIES.items()),
    *(pytest.param(name, make, id=name, marks=pytest.mark.slow) for name, make in SLOW_FAMILIES.items()),
]
RAY_DEFAULT = {"mixtral"}
"""The family trained through Ray in the default run (the others: in the slow run; every
family in process in the default run)."""
ALL_FAMILIES = {**FAMILIES, **SLOW_FAMILIES}


def _family_config(config_path: Path, family: str, world: int = 2):
    extra = {"data__block_size": 32} if family in NO_CONTEXT else {}
    return tiny_config(hf__config_path=str(config_path), steps=STEPS, worker__num_workers=world, **extra)


def _train_families(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of each family in turn, in one process group; each family's config in
    ``<folder>/configs/<family>``."""
    with gloo_group(rank, world, port):
        for family in ALL_FAMILIES:
            config = _family_config(Path(folder) / "configs" / family, family, world)
            train_in_process(rank, config, Path(folder) / family)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("family", "make"),
    [
        pytest.param(name, make, id=name, marks=() if name in RAY_DEFAULT else pytest.mark.slow)
        for name, make in ALL_FAMILIES.items()
    ],
)
def test_family_trains_bitwise(ray_local, tmp_path: Path, family: str, make: Callable[[], object]) -> None:
    # Here, not at the top: the in-process twin's spawned ranks import this module, without Ray.
    from cargohold.cluster.export import master_weights
    from cargohold.cluster.launcher import TrainingSession

    make().save_pretrained(tmp_path)
    config = _family_config(tmp_path, family)
    assert build_model(model_spec(config), config.data).hf.config.model_type == family
    _, _, layout = config_layout(config)
    with TrainingSession(config) as session:
        losses = [session.step().loss for _ in range(config.steps)]
        masters = master_weights(layout, session.server_masters())
    reference = reference_train(config, config.steps)
    assert losses == reference.losses
    expected = reference.flat(layout)
    assert torch.equal(masters, expected), f"masters differ by {(masters - expected).abs().max():.3e}"
    assert losses[-1] < losses[0], losses


def test_families_train_bitwise_without_ray(tmp_path: Path) -> None:
    """Every family through the worker step (FSDP2 over gloo, the registry in-process) at
    2 workers: losses, masters, moments and weights equal the reference's; the loss falls.
    (After the Ray test: a module whose first test asks for no Ray stops the one an earlier
    module left running, tests/conftest.py.)"""
    for family, make in ALL_FAMILIES.items():
        make().save_pretrained(tmp_path / "configs" / family)
    results = run_ranks(_train_families, 2, str(tmp_path), ALL_FAMILIES)
    for family, ranks in results.items():
        config = _family_config(tmp_path / "configs" / family, family)
        with torch.device("meta"):
            assert build_model(model_spec(config), config.data).hf.config.model_type == family
        _, _, layout = config_layout(config)
        assert_matches_reference(family, ranks, layout, reference_train(config, config.steps))
        losses = ranks[0]["losses"]
        assert losses[-1] < losses[0], (family, losses)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        # xIELU's learnable alpha_p/alpha_n are set in the activation's constructor, not by _init_weights.
        (lambda: T.ApertusConfig(**GQA), "act_fn.alpha_p"),
        # mup_vector is a buffer the constructor computes and _init_weights does not.
        (lambda: T.FalconH1Config(**GQA, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8), "mup_vector"),
    ],
    ids=["apertus", "falcon_h1"],
)
def test_families_whose_initialisation_is_outside_init_weights_are_refused(
    tmp_path: Path, make: Callable[[], object], named: str
) -> None:
    """Workers build the model on the meta device and draw each module's values by its
    ``_init_weights``: what a constructor sets by itself cannot be drawn that way, so a
    fresh model of such a family is refused, naming the tensor (a checkpoint_dir, whose
    values are read, is not concerned)."""
    make().save_pretrained(tmp_path)
    config = tiny_config(hf__config_path=str(tmp_path))
    with torch.device("meta"):
        model = build_model(model_spec(config), config.data)
    with pytest.raises(ConfigError, match=named):
        list(parameter_values(model_spec(config), model))
        list(buffer_values(config.seed, model))


@pytest.mark.parametrize(("family", "make"), PARAMS)
def test_the_families_that_confine_attention_to_each_document_are_the_listed_ones(
    family: str, make: Callable[[], object]
) -> None:
    """Rows of whole documents rely on restarting position ids confining attention: a row of
    two documents must give each document's logits alone exactly for the families listed
    in DOCUMENT_MASKING_FAMILIES (which may then train on them), and must not for the others
    (refused with data.packing: documents)."""
    from cargohold.services.models.dimensions import DOCUMENT_MASKING_FAMILIES

    config = make()
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 320, (1, 20))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(input_ids=part, use_cache=False).logits for part in (ids[:, :12], ids[:, 12:])], dim=1)
    confined = torch.allclose(packed, alone, atol=1e-5)
    assert confined == (config.model_type in DOCUMENT_MASKING_FAMILIES), (family, (packed - alone).abs().max())
