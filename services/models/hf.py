"""Hugging Face ``transformers`` causal language models, trained like the built-in GPT.

The ``hf`` config section names either a causal-LM *config* (a local folder holding
``config.json``, or the file itself; the weights are initialised from ``seed``) or a local
*checkpoint* folder (``save_pretrained`` output; training starts from its weights). The
model is wrapped in :class:`HFCausalLM`, which gives the trainer's model contract
``forward(idx, targets) -> (logits, mean loss)``.

Nothing is ever downloaded: each path must exist on disk, and every transformers call
passes ``local_files_only=True`` (the effect of ``HF_HUB_OFFLINE=1``, without setting it
for the whole process). A checkpoint's weights are read from safetensors files only: a
folder holding only pickle files (``pytorch_model.bin``) is refused before anything reads
it (:func:`~cargohold.services.models.weights.require_safetensors`), since unpickling can
run code. cargohold runs no code from a model folder: a folder whose
config.json or tokenizer_config.json maps classes to its own modules (``auto_map``) is
refused before transformers sees it (:func:`refuse_folder_code`; transformers would ask
at a terminal whether to run it), and every call passes ``trust_remote_code=False``.

transformers is an optional dependency (``pip install 'cargohold[hf]'``); it is imported
only when an ``hf`` path is set, so the built-in GPT trains without it.

Three things make these models fit the trainer's correctness contract (offloaded training
equals single-process AdamW bitwise):

* **Loss.** HF's own loss shifts the labels by one; cargohold's batches are already
  ``y = x`` shifted, so the wrapper computes the mean cross-entropy of the logits against
  ``targets`` itself, in fp32, exactly as :class:`~cargohold.services.models.gpt.GPT` does
  (:func:`~cargohold.services.models.loss.mean_token_loss`).
* **No dropout.** The inner model always runs in eval mode, whatever ``train()`` says:
  dropout would draw different masks on each rank and in the reference. (transformers
  models change nothing else between the two modes that training here uses.)
* **Buffers.** The worker points each *parameter* at its flat weight buffer and never
  moves the module, so buffers (e.g. Llama's rotary ``inv_freq``) would stay on the CPU
  and a ``.to(bfloat16)`` would round them. The wrapper keeps every floating buffer as it
  was built (fp32) and puts it on the input's device on first use, so a worker on a GPU
  and the CPU reference compute the same thing.

Tied input/output embeddings (``tie_word_embeddings``) are one ``Parameter`` used twice:
``parameters()`` yields it once, so it has one place in the flat buffer, one AdamW state,
and one gradient (autograd sums both uses before accumulating it). Pointing its ``.data``
at the flat buffer keeps the tie. Parameter names carry the prefix ``hf.``
(:data:`PREFIX`); exports strip it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cargohold.cluster.schema.model import HFModelConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.loss import mean_token_loss
from cargohold.services.models.weights import require_safetensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

PREFIX = "hf."
"""What :class:`HFCausalLM` adds in front of the transformers parameter names."""


class HFCausalLM(nn.Module):
    """A transformers causal LM with the trainer's contract (see the module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = model
        # Plain references, not registered: .to()/_apply leave them alone, deepcopy follows.
        self._buffers_as_built = [
            (module, name, buffer)
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and buffer.is_floating_point()
        ]
        self.hf.eval()

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf.eval()  # dropout stays off: see the module docstring
        return self

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, T, vocab_size]`` for token ids ``idx`` ``[B, T]`` and, with
        ``targets``, the mean cross-entropy over the counted targets, in fp32 (no label shift).
        ``position_ids`` restarting within a row mark packed documents: transformers then
        confines attention to each (``masking_utils.find_packed_sequence_indices``)."""
        self._place_buffers(idx.device)
        logits = self.hf(input_ids=idx, position_ids=position_ids, use_cache=False).logits
        if targets is None:
            return logits, None
        return logits, mean_token_loss(logits, targets)

    def set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Give a model built on the meta device its buffers as built (fp32, by qualified
        name under this wrapper, e.g. ``hf.model.rotary_emb.inv_freq``)."""
        modules = dict(self.named_modules())
        for index, (module, name, _) in enumerate(self._buffers_as_built):
            qualified = next(f"{m}.{name}" if m else name for m, candidate in modules.items() if candidate is module)
            value = values[qualified]
            module._buffers[name] = value
            self._buffers_as_built[index] = (module, name, value)

    def _place_buffers(self, device: torch.device) -> None:
        for module, name, built in self._buffers_as_built:
            current = module._buffers[name]
            if current is None or current.device != device or current.dtype != built.dtype:
                module._buffers[name] = built.to(device)


def build_hf_model(config: HFModelConfig) -> HFCausalLM:
    """The fp32 model ``config`` names: fresh weights from the global torch seed (the
    caller seeds), or the checkpoint's. Under ``torch.device("meta")`` only the shapes are
    built, from the checkpoint's config."""
    transformers = _transformers()
    pretrained = pretrained_config(config)
    on_meta = torch.get_default_device().type == "meta"
    try:
        if config.checkpoint_dir is not None and not on_meta:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                _local(config.checkpoint_dir),
                config=pretrained,
                dtype=torch.float32,
                local_files_only=True,
                trust_remote_code=False,
                use_safetensors=True,  # never a pickle file (require_safetensors refused a folder without)
            )
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                pretrained, dtype=torch.float32, trust_remote_code=False
            )
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot build a causal LM from {config.key}={config.path!r}: {error}") from error
    return HFCausalLM(model)


def pretrained_config(config: HFModelConfig) -> PretrainedConfig:
    """The transformers config of the model ``config`` names, read from disk only."""
    transformers = _transformers()
    path = _local(config.path)
    named = f"{config.key}={config.path!r}"
    refuse_folder_code(path if path.is_dir() else path.parent, named)
    if config.checkpoint_dir is not None:
        require_safetensors(path, named)  # before transformers looks for weights in any other format
    try:  # a folder, or a config.json itself
        loaded = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:  # JSONDecodeError is a ValueError
        raise ConfigError(f"cannot read a transformers config from {config.key}={config.path!r}: {error}") from error
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if loaded.model_type not in causal:
        raise ConfigError(
            f"{config.key}={config.path!r} is a {loaded.model_type!r} model, not a causal LM "
            "that transformers.AutoModelForCausalLM can build"
        )
    return loaded


CODE_MAPS = ("config.json", "tokenizer_config.json")
"""The files of a model folder whose ``auto_map`` names the folder's own code."""


def refuse_folder_code(folder: Path, named: str) -> None:
    """Refuse ``folder`` (``named``: the config key and value, for the message) when one
    of its :data:`CODE_MAPS` maps classes to the folder's own modules."""
    for name in CODE_MAPS:
        path = folder / name
        try:
            declared = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # missing or unreadable: transformers' own error names it
        except RecursionError:
            raise ConfigError(f"{named}: {path} is nested too deeply to read (past Python's recursion limit)") from None
        if isinstance(declared, dict) and declared.get("auto_map"):
            raise ConfigError(
                f"{named}: {path} has auto_map (code of its own: {sorted(declared['auto_map'])}); cargohold runs "
                "no code from a model folder. Use a model transformers implements itself"
            )


def model_folder(config: HFModelConfig) -> Path:
    """The folder of the model ``config`` names: the checkpoint folder, or the folder of
    the config (where ``save_pretrained`` puts the tokenizer and generation config too)."""
    path = _local(config.path)
    return path if path.is_dir() else path.parent


def hf_name(name: str) -> str:
    """The transformers name of a parameter of :class:`HFCausalLM`."""
    return name.removeprefix(PREFIX)


def _local(path: str) -> Path:
    # Absolute, so transformers can never read it as a hub repo id.
    return Path(path).expanduser().resolve()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ConfigError(
            "hf.config_path / hf.checkpoint_dir need the transformers package: pip install 'cargohold[hf]'"
        ) from error
    return transformers
