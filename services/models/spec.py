"""The model a run trains, as the config names it: the sections of it that building,
sizing and initialising the model read, without the rest of the run's config."""

from __future__ import annotations

from dataclasses import dataclass

from cargohold.cluster.schema.model import GPTConfig, HFModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The built-in GPT's shape (``model.*``) or the transformers model (``hf.*``) that
    replaces it, and the seed its fresh weights are drawn from."""

    gpt: GPTConfig
    """``model.*``: used when ``hf`` names no model."""
    hf: HFModelConfig
    """``hf.*``: a local transformers causal LM, when enabled."""
    seed: int = 0
    """Seeds the model's initialisation (``seed``); a checkpoint's weights ignore it."""
