"""What a run resumes from, and whether it may.

``checkpoint.resume`` names a checkpoint folder, a folder of them, or ``latest`` in
``checkpoint.dir``: :func:`resolve_resume` finds the complete checkpoint it means.
:func:`check_resume` then reads its manifest and checks, before any actor starts, that
the configuration it was saved with (the manifest holds it whole) differs from this
run's only where a resume may change it, and that it is of this model. Every refusal is
a :class:`ResumeRefusedError` (exit status 2) naming the file, field or keys.

Every key is compared but ``checkpoint.resume`` (how a run starts, not what it is):

* **refused** where the difference would give the saved state another meaning
  (:data:`REFUSED`): the model's shape (``model.*`` but ``dropout``), the rates the
  saved Adam moments were averaged with (``optim.betas``: their bias correction at the
  saved update count assumes them), and the data stream the saved
  step is a position in (``seed``, ``data.seed``, ``data.path``,
  ``data.corpus_bytes``: batches and dropout's draws are a function of them and the
  step, so a resume that promises to continue the run bitwise could not);
* **warned about** otherwise, in one line: the learning-rate schedule and the other
  optimizer settings (weight decay and param groups too: the saved moments are per
  element, whatever group updates them), ``steps``, batch size, worker and server counts, dtypes, tiers,
  paths, metrics, logging. The saved state keeps its meaning and the run goes on from it
  as now configured; with other numbers than the saved run's, it is no longer bitwise
  that run's continuation. ``data.micro_batches`` is one of these, as ``data.batch_size``
  is (the global batch is their product), and so is ``eval.*`` (validation reads no
  state). ``hf.*`` are paths, compared as such: another model behind
  them is refused by its parameters (:func:`check_compatible`). ``optim.state_dtype``
  is one of these too: the state servers convert the saved moments (decode them to
  fp32, store them in this run's kind) as they restore them, and that is logged. A
  checkpoint whose config lacks it was saved before the key existed, when the moments
  were always fp32: the warning says so (:data:`BEFORE_STATE_DTYPE`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cargohold.cluster.schema.io import to_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import model_spec
from cargohold.services.checkpoint import CheckpointDir, Manifest, check_compatible
from cargohold.services.core.errors import CheckpointError, ResumeRefusedError
from cargohold.services.core.layout import Layout
from cargohold.services.core.loss_scale import LossScaleState
from cargohold.services.data.tokens import bin_dtype
from cargohold.services.models.dimensions import vocab_size

logger = logging.getLogger(__name__)

NOT_COMPARED = frozenset({"checkpoint.resume"})
_MODEL = "another model than the one the saved weights are of"
_MOMENTS = "the saved Adam moments were averaged at the checkpoint's rate"
_DATA = "another data stream than the one the saved step is a position in"
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        ("model.vocab_size", "model.block_size", "model.n_layer", "model.n_head", "model.n_embd", "model.bias"), _MODEL
    ),
    "optim.betas": _MOMENTS,
    **dict.fromkeys(
        (
            "seed",
            "data.seed",
            "data.format",
            "data.path",
            "data.corpus_bytes",
            "data.block_size",
            "data.tokenizer",
            "data.field",
            "data.split",
        ),
        _DATA,
    ),
    "data.token_dtype": (
        "the saved run read the .bin file's ids in that dtype, a key set then; this run reads them in the one "
        "the model's vocabulary gives: uint16 up to 65,536 ids, uint32 above"
    ),
}
"""The keys a resume may not change, and why."""
TOKEN_DTYPE = "data.token_dtype"
"""A retired key a checkpoint may hold: the dtype of a ``.bin`` file is derived now."""
STATE_DTYPE = "optim.state_dtype"
BEFORE_STATE_DTYPE = 'absent (saved before the key existed: fp32 moments, as "float32")'
"""How the warnings show a checkpoint's missing ``optim.state_dtype``: every checkpoint from
before the key stores its moments in fp32."""


@dataclass(frozen=True, slots=True)
class Change:
    """A key whose value differs between the checkpoint's config and this run's (JSON
    text; ``absent`` where one of them lacks the key, e.g. one added since)."""

    key: str
    saved: str
    current: str


def resolve_resume(spec: str | None, store: CheckpointDir | None) -> Path | None:
    """The complete checkpoint folder ``checkpoint.resume`` means (None: start fresh)."""
    if spec is None:
        return None
    try:
        if spec == "latest":
            return store.resolve("latest") if store is not None else None
        return CheckpointDir(Path(spec).parent).resolve(spec)
    except CheckpointError as error:
        raise ResumeRefusedError(f"checkpoint.resume {spec!r}: {error}") from error


def check_resume(directory: Path, config: TrainConfig, layout: Layout) -> Manifest:
    """The manifest of the checkpoint at ``directory`` once it is found to fit this run:
    refused keys raise, the other changed keys are logged as a warning."""
    try:
        manifest = CheckpointDir(directory.parent).load(directory)
    except CheckpointError as error:
        raise ResumeRefusedError(f"checkpoint.resume: {error}") from error
    changes = config_changes(manifest.config, config)
    refused = [c for c in changes if c.key in REFUSED]
    if refused:
        raise ResumeRefusedError(
            f"checkpoint.resume: {directory} was saved with a configuration this run cannot resume from: "
            + "; ".join(f"{c.key} is {c.saved} there and {c.current} here ({REFUSED[c.key]})" for c in refused)
            + ". Resume with the checkpoint's values, or start a new run"
        )
    try:
        check_compatible(manifest, model_signature=[(p.name, p.shape) for p in layout.params], align=layout.align)
    except CheckpointError as error:
        raise ResumeRefusedError(f"checkpoint.resume: {directory}: {error}") from error
    converted = next((c for c in changes if c.key == STATE_DTYPE), None)
    if converted is not None and not (converted.saved == "absent" and config.optim.state_dtype == "float32"):
        logger.warning(
            "resuming from %s: %s is %s there and %s here; the saved Adam moments are converted "
            "(decoded to fp32, stored as %s) as they are restored",
            directory,
            STATE_DTYPE,
            _saved_value(converted),
            converted.current,
            config.optim.state_dtype,
        )
    if changes:
        logger.warning(
            "resuming from %s with config keys changed (the saved state keeps its meaning; the run goes on "
            "from it as now configured): %s",
            directory,
            "; ".join(f"{c.key}: {_saved_value(c)} -> {c.current}" for c in changes),
        )
    return manifest


def _saved_value(change: Change) -> str:
    """The checkpoint's side of a change as the warnings show it."""
    return BEFORE_STATE_DTYPE if change.key == STATE_DTYPE and change.saved == "absent" else change.saved


def config_changes(saved: dict[str, Any], config: TrainConfig) -> list[Change]:
    """Every key (dotted, as in overrides) whose value in ``saved`` (a config as plain
    data, as a manifest holds it) differs from ``config``'s, in key order."""
    current = json.loads(json.dumps(to_dict(config)))  # the form a manifest holds it in
    sections = _sections(config)
    theirs, ours = _flatten(_in_current_keys(saved), sections), _flatten(current, sections)
    _derive_token_dtype(theirs, ours, config)
    changes = []
    for key in sorted(theirs.keys() | ours.keys()):
        before, after = (_shown(side, key) for side in (theirs, ours))
        if before != after and key not in NOT_COMPARED:
            changes.append(Change(key, before, after))
    return changes


def _derive_token_dtype(theirs: dict[str, Any], ours: dict[str, Any], config: TrainConfig) -> None:
    """A checkpoint saved while ``data.token_dtype`` said how a ``.bin`` token file holds
    its ids: where both runs read one, the dtype this run derives from the model's
    vocabulary is compared with it (:data:`REFUSED` where they differ); elsewhere the key
    was never read and is dropped."""
    saved = theirs.pop(TOKEN_DTYPE, None)
    if saved is None or not (_reads_bin(theirs) and _reads_bin(ours)):
        return
    ours[TOKEN_DTYPE] = str(bin_dtype(vocab_size(model_spec(config))))
    if ours[TOKEN_DTYPE] != saved:
        theirs[TOKEN_DTYPE] = saved
    else:
        del ours[TOKEN_DTYPE]


def _reads_bin(flat: dict[str, Any]) -> bool:
    """Whether a config (flattened) trains on a ``.bin`` token file."""
    path = flat.get("data.path")
    return flat.get("data.format") == "tokens" and isinstance(path, str) and path.endswith(".bin")


def _in_current_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config as this version's keys hold it: an older checkpoint holds
    ``optim.betas`` as ``optim.beta1`` and ``optim.beta2``, a text file of
    ``data.format: bytes`` in ``data.corpus_path`` (its ``data.path`` then null),
    ``progress``, ``worker.device`` and ``security.auth_token_env``, which no key sets now
    (``worker.gpus`` picks the device; the token is always read from
    ``$CARGOHOLD_AUTH_TOKEN``), ``metrics.enabled: false`` (a null ``metrics.port`` now),
    and mutual TLS as three files (``security.tls_*_file``; null: no TLS, as a
    null ``security.tls_dir``)."""
    saved = {k: v for k, v in saved.items() if k != "progress"}
    metrics = saved.get("metrics")
    if isinstance(metrics, dict) and "enabled" in metrics:
        rest = {k: v for k, v in metrics.items() if k != "enabled"}
        saved["metrics"] = rest if metrics["enabled"] else {**rest, "port": None}
    worker = saved.get("worker")
    if isinstance(worker, dict) and "device" in worker:
        saved["worker"] = {k: v for k, v in worker.items() if k != "device"}
    optim = saved.get("optim")
    if isinstance(optim, dict) and "beta1" in optim and "beta2" in optim and "betas" not in optim:
        rest = {k: v for k, v in optim.items() if k not in ("beta1", "beta2")}
        saved["optim"] = {**rest, "betas": [optim["beta1"], optim["beta2"]]}
    data = saved.get("data")
    if isinstance(data, dict) and "corpus_path" in data:
        rest = {k: v for k, v in data.items() if k != "corpus_path"}
        saved["data"] = {**rest, "path": data["corpus_path"]} if data["corpus_path"] is not None else rest
    security = saved.get("security")
    if isinstance(security, dict) and "auth_token_env" in security:
        security = saved["security"] = {k: v for k, v in security.items() if k != "auth_token_env"}
    tls = ("tls_cert_file", "tls_key_file", "tls_ca_file")
    if isinstance(security, dict) and any(key in security for key in tls):
        rest = {k: v for k, v in security.items() if k not in tls}
        saved["security"] = rest if any(security.get(key) for key in tls) else {"tls_dir": None, **rest}
    return saved


def _sections(node: object, prefix: str = "") -> frozenset[str]:
    """Dotted names of the config's sections (its nested dataclasses)."""
    found: set[str] = set()
    for field in dataclasses.fields(node):  # type: ignore[arg-type]
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            found |= {prefix + field.name, *_sections(value, f"{prefix}{field.name}.")}
    return frozenset(found)


def _flatten(data: dict[str, Any], sections: frozenset[str], prefix: str = "") -> dict[str, Any]:
    """Keys to values, descending only into sections: a mapping-valued key
    (``worker.resources``) is one value."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = prefix + key
        if dotted in sections and isinstance(value, dict):
            flat.update(_flatten(value, sections, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _shown(flat: dict[str, Any], key: str) -> str:
    """The value as JSON text, which tells 1, 1.0, true and "1" apart."""
    return json.dumps(flat[key], sort_keys=True) if key in flat else "absent"


def restored_loss_scale(manifest: Manifest | None) -> LossScaleState | None:
    """The dynamic loss scale a resume goes on with: the checkpoint's, where it has one
    (an fp16 run saved it); else None, and an fp16 run starts from
    ``tuning.optim.loss_scale.init_scale``."""
    if manifest is None or manifest.loss_scale is None:
        return None
    return LossScaleState(manifest.loss_scale.scale, manifest.loss_scale.growth_tracker)
