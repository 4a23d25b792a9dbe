"""The activations backward keeps for one batch: an estimate, from the model's shape."""

from __future__ import annotations

import torch

from cargohold.cluster.plan.itemsize import DTYPE_BYTES, FP32_BYTES
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import model_spec
from cargohold.services.models.dimensions import sequence_length


def activation_bytes_estimate(config: TrainConfig, model: torch.nn.Module | None = None) -> int:
    """Activations backward keeps for one batch, after Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", eq. 1): 34·s·b·h bytes per layer
    at 2-byte activations for a 4h-wide MLP, without the 5·a·s²·b of a materialised score
    matrix (the models use fused attention), scaled to the compute dtype. Of the 34, 16
    are the MLP's wide tensors (its up-projection's output and the activation's, 2 bytes
    each at width 4h); for a model (``model``, on the meta device) with another MLP width
    ``I`` or a gated MLP (SwiGLU: gate and up outputs, the activation's, their product)
    they become 4·I per up-projection, so a layer keeps 18·h + 4·k·I, k the number of
    up-projections. With ``worker.activation_checkpointing: blocks`` only each block's
    input (s·b·h) stays, plus one block's full activations while it is recomputed. Plus
    the logits in the compute dtype, their fp32 copy for the loss and its gradient."""
    layers, width, vocab = config.model.n_layer, config.model.n_embd, config.model.vocab_size
    intermediate, up_projections = 4 * width, 1
    inner = getattr(getattr(model, "hf", None), "config", None)  # HFCausalLM.hf: the PreTrainedModel
    if config.hf.enabled and inner is not None:
        layers = getattr(inner, "num_hidden_layers", layers)
        width = getattr(inner, "hidden_size", width)
        vocab = getattr(inner, "vocab_size", vocab)
        intermediate = next(
            (
                v
                for v in (getattr(inner, key, None) for key in ("intermediate_size", "n_inner", "ffn_dim"))
                if isinstance(v, int) and v > 0
            ),
            intermediate,
        )
    if model is not None and intermediate != width:
        up_projections = max(1, _matrices_of_width(model, width, intermediate) - 1)  # less the down-projection
    compute = DTYPE_BYTES[config.worker.compute_dtype]
    tokens = config.data.batch_size * sequence_length(model_spec(config), config.data)
    per_layer = tokens * (18 * width + 4 * up_projections * intermediate) * compute // 2
    logits = tokens * vocab * (compute + 2 * FP32_BYTES)
    if config.worker.activation_checkpointing == "blocks":
        return layers * tokens * width * compute + per_layer + logits
    return layers * per_layer + logits


def _matrices_of_width(model: torch.nn.Module, width: int, intermediate: int) -> int:
    """Weight matrices of the first transformer block mapping ``width`` to ``intermediate``
    or back (either orientation: transformers' Conv1D stores them transposed)."""
    from cargohold.services.models.blocks import transformer_blocks

    _, block = transformer_blocks(model)[0]
    shapes = {(width, intermediate), (intermediate, width)}
    return sum(1 for p in block.parameters() if tuple(p.shape) in shapes)
