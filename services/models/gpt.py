"""A small GPT-style decoder (after karpathy/nanoGPT's ``model.py``), byte-level by default.

Pre-LayerNorm blocks, learned position embeddings, causal attention through
``scaled_dot_product_attention``. It differs from nanoGPT in one deliberate way: the
output head is *not* tied to the token embedding. The trainer lays parameters out in one
flat buffer by ``named_parameters()`` and needs every parameter to be its own tensor.

The model owns no buffers (the causal mask comes from ``is_causal=True``), so building it
under ``with torch.device("meta"):`` yields every shape without allocating memory.

Construction does not draw the model's initialisation: ``GPT(config)`` holds torch's
default values. GPT-2's rule lives in :meth:`GPT.init_module`, one module at a time, and
:mod:`cargohold.services.models.init` applies it with a seed per module, so a worker can
compute the initial values of just its shard of the model
(:func:`~cargohold.services.models.init.initial_values`) and get exactly what
:func:`~cargohold.services.models.init.initialize` gives the whole model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.loss import mean_token_loss


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and the past."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: bool ``[B, 1, T, T]``, True where a query may attend (None: causal)."""
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, four times as wide as the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model returning logits and, given targets, the mean loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # Untied on purpose: see the module docstring.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2's initialisation of the parameters ``module`` owns directly; ``name`` is
        its qualified name in this model. Draws from torch's global RNG, which
        :func:`cargohold.services.models.init.initialize` seeds per module."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if name.endswith((".attn.c_proj", ".mlp.c_proj")):
                # Each block adds two projections (attention, MLP) to the residual stream,
                # so its variance grows with 2 * n_layer; GPT-2 (Radford et al. 2019,
                # section 2.3) scales them by 1/sqrt(2 * n_layer) to keep the stream's
                # scale independent of depth.
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, T, vocab_size]`` for token ids ``idx`` ``[B, T]``.

        With ``targets`` (same shape as ``idx``) also returns the mean cross-entropy over
        the counted targets, in fp32 (:func:`~cargohold.services.models.loss.mean_token_loss`).
        ``position_ids`` (same shape) restarting at 0 mark packed documents: each position
        attends only to earlier ones of its own document.
        """
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ConfigError(f"sequence length {seq} exceeds model.block_size ({self.config.block_size})")
        if position_ids is None:
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(seq, device=idx.device)))
            mask = None
        else:
            x = self.drop(self.wte(idx) + self.wpe(position_ids))
            mask = document_mask(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, mean_token_loss(logits, targets)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, T, T]``: query i may attend to key j <= i of its own document, a
    document starting wherever the position ids do not go up by one (as transformers'
    ``find_packed_sequence_indices`` reads them)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = starts.cumsum(dim=1)
    same = document[:, :, None] == document[:, None, :]
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def num_parameters(model: nn.Module) -> int:
    """Total number of parameter elements (works on meta-device models too)."""
    return sum(p.numel() for p in model.parameters())
