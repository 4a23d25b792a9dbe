"""Export trained weights as safetensors, for use outside cargohold.

At the end of a run with ``export_dir`` set, the launcher reassembles the fp32 master
weights from the state servers (not a worker's compute-dtype copy) and calls
:func:`export_weights`:

* an ``hf`` model becomes a transformers folder (``config.json``, ``model.safetensors``,
  ``generation_config.json``) written by transformers' own ``save_pretrained``, so names,
  tied weights (stored once, re-tied on load) and sharding are what transformers expects::

      model = transformers.AutoModelForCausalLM.from_pretrained(export_dir)
      tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)

* the built-in GPT becomes ``model.safetensors`` (its ``named_parameters()`` names) and
  ``cargohold_gpt.json`` (the ``model`` config section)::

      model = cargohold.cluster.export.load_exported_gpt(export_dir)

Beside the weights goes the tokenizer the run's data was tokenized with
(:func:`exported_tokenizer`), written by its own ``save_pretrained`` (``tokenizer.json``,
``tokenizer_config.json``, the chat template), so the folder is what
``save_pretrained`` of a model and its tokenizer gives. Byte-level data (ids 0..255)
has no tokenizer to export.

The generation config is the model folder's ``generation_config.json`` when it has one
(the model author's: kept as it is); otherwise transformers derives it from the model's
config, and the tokenizer's BOS, EOS and pad ids fill in what that leaves unset. EOS
matters most: it ends each packed document and each chat turn the model learned, so it is
where ``generate`` should stop.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.model import GPTConfig, HFModelConfig
from cargohold.services.core.durable import replace_durably
from cargohold.services.core.errors import ConfigError, ExportError
from cargohold.services.core.layout import Layout, gather_params
from cargohold.services.data.tokenizer import TOKENIZER_FILES, load_tokenizer, tokenizer_folder
from cargohold.services.models.build import build_model
from cargohold.services.models.dimensions import vocab_size
from cargohold.services.models.gpt import GPT
from cargohold.services.models.hf import HFCausalLM, hf_name, model_folder
from cargohold.services.models.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

WEIGHTS_FILE = "model.safetensors"
GPT_CONFIG_FILE = "cargohold_gpt.json"
GPT_FORMAT = "cargohold-gpt"
GPT_FORMAT_VERSION = 1
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The generation config's ids that a tokenizer defines too."""


def master_weights(layout: Layout, masters: list[dict[int, torch.Tensor]]) -> torch.Tensor:
    """The flat fp32 master weights, reassembled from every state server's segments
    (``TrainingSession.server_masters()``); zeros in the padding."""
    flat = torch.zeros(layout.total, dtype=torch.float32)
    seen: set[int] = set()
    for server in masters:
        for segment_id, weights in server.items():
            segment = layout.segments[segment_id]
            flat[segment.start : segment.stop] = weights
            seen.add(segment_id)
    missing = sorted(set(range(len(layout.segments))) - seen)
    if missing:
        raise ExportError(f"the state servers hold no master weights for segments {missing[:10]}")
    return flat


def export_weights(
    model_spec: ModelSpec, data: DataConfig, layout: Layout, flat: torch.Tensor, out_dir: str | Path
) -> Path:
    """Write the fp32 weights ``flat`` (laid out by ``layout``) of the model ``model_spec``
    describes, trained on ``data``, into ``out_dir`` (created if needed); returns the folder."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != layout.total:
        raise ExportError(
            f"export needs the flat fp32 master weights ({layout.total} elements), got "
            f"{flat.dtype} of shape {tuple(flat.shape)}"
        )
    with torch.device("meta"):  # names and shapes only
        model = build_model(model_spec, data)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if expected != {p.name: p.shape for p in layout.params}:
        raise ExportError(
            "the layout does not match the model the config describes; export with the config the run trained"
        )
    out = Path(out_dir)
    gathered = gather_params(layout, flat.cpu())
    weights = {name: gathered[name] for name in expected}  # the model's order, not the layout's units
    tokenizer = exported_tokenizer(model_spec, data)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(model, HFCausalLM):
            model.hf.generation_config = _generation_config(model_spec.hf, model.hf, tokenizer)
            model.hf.save_pretrained(out, state_dict={hf_name(n): w for n, w in weights.items()})
        else:
            _save_gpt(model_spec.gpt, weights, out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    except (OSError, ValueError) as error:  # ValueError: transformers refuses an invalid generation config
        raise ExportError(f"cannot write the export to export_dir={str(out)!r}: {error}") from error
    return out


def exported_tokenizer(model: ModelSpec, data: DataConfig) -> PreTrainedTokenizerBase | None:
    """The tokenizer an export of a run of ``model`` on ``data`` carries: the one its data
    was tokenized with (``data.tokenizer``, else the ``hf`` model's folder), or for
    pre-tokenized data the one found there; None for byte-level data, or when no folder
    holds one."""
    if data.format == "bytes":
        return None
    try:
        folder, key = tokenizer_folder(data, model.hf)
    except ConfigError:  # pre-tokenized data, and neither data.tokenizer nor an hf model
        return None
    if data.format == "tokens" and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return load_tokenizer(folder, key, vocab_size(model))
    except ConfigError as error:
        raise ExportError(f"cannot export the tokenizer: {error}") from error


def load_exported_gpt(directory: str | Path) -> GPT:
    """The built-in GPT of an export, with its trained weights, in eval mode."""
    directory = Path(directory)
    spec_file, weights_file = directory / GPT_CONFIG_FILE, directory / WEIGHTS_FILE
    try:
        spec = json.loads(spec_file.read_text(encoding="utf-8"))
        if spec.get("format") != GPT_FORMAT or spec.get("version") != GPT_FORMAT_VERSION:
            raise ExportError(f"{spec_file} is not a {GPT_FORMAT} v{GPT_FORMAT_VERSION} export")
        config = GPTConfig(**spec["model"])
        state = load_file(weights_file)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ConfigError, SafetensorError) as error:
        raise ExportError(f"cannot read the GPT export in {directory}: {error}") from error
    with torch.device("meta"):
        model = GPT(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:
        raise ExportError(f"{weights_file} does not hold the weights of {spec_file}'s model: {error}") from error
    return model.eval()


def _generation_config(
    hf: HFModelConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
) -> GenerationConfig:
    """The model folder's generation config as it is, else the model's own with the
    tokenizer's special ids where it has none (see the module docstring)."""
    from transformers import GenerationConfig

    folder = model_folder(hf)
    if (folder / GENERATION_CONFIG_FILE).is_file():
        try:
            return GenerationConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ExportError(f"cannot read {folder / GENERATION_CONFIG_FILE}: {error}") from error
    generation = copy.deepcopy(model.generation_config)
    for name in SPECIAL_IDS if tokenizer is not None else ():
        if getattr(generation, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(generation, name, getattr(tokenizer, name))
    return generation


def _save_gpt(config: GPTConfig, weights: dict[str, torch.Tensor], out: Path) -> None:
    spec = {"format": GPT_FORMAT, "version": GPT_FORMAT_VERSION, "model": dataclasses.asdict(config)}
    # Each file is written beside its final name and renamed over it: never half a file.
    with replace_durably(out / WEIGHTS_FILE) as temporary:
        save_file(weights, temporary, metadata={"format": "pt"})
    with replace_durably(out / GPT_CONFIG_FILE) as temporary:
        Path(temporary).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
