"""docs/api.md: its reference is what the docstrings of the public names render to now,
and its launcher example is a valid config whose param groups match the model (its OffloadedAdamW loop runs in
test_offloaded_adamw_ray.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cargohold
from cargohold import reference
from cargohold.cluster.schema.io import load_config
from cargohold.cluster.sections import config_layout
from cargohold.services.worker.param_groups import resolve_param_groups

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_checked_in_reference_is_current() -> None:
    assert DOC.read_text() == reference.render(DOC.read_text()), (
        f"docs/api.md is stale: run `{reference.REGENERATE}` and commit the result"
    )


def test_the_check_fails_on_a_stale_reference_and_keeps_the_examples(tmp_path: Path) -> None:
    stale = tmp_path / "api.md"
    stale.write_text(DOC.read_text().replace("One AdamW update", "Two AdamW updates"))
    assert reference.main(["--check", str(stale)]) == 1
    head = "# Examples\n\nkept as written\n\n" + reference.MARKER + "\nold reference\n"
    assert reference.render(head).startswith(
        "# Examples\n\nkept as written\n\n" + reference.MARKER + "\n\n## Reference"
    )
    with pytest.raises(ValueError, match="has no line"):
        reference.render("# no marker\n")


def test_every_public_name_is_in_the_reference() -> None:
    assert set(reference.PUBLIC) == set(cargohold.__all__) - {"__version__"}
    for name in reference.PUBLIC:
        assert f"`cargohold.{name}(" in DOC.read_text()


def test_the_launcher_example_is_a_valid_config(tmp_path: Path) -> None:
    match = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert match is not None
    (tmp_path / "run.yaml").write_text(match.group(1))
    config = load_config(str(tmp_path / "run.yaml"), [])
    assert config.state_server.num_servers == 2 and config.checkpoint.every_steps == 50
    groups = resolve_param_groups(config.optim, config_layout(config)[2].params)  # its patterns match
    assert len(groups.groups) == 3  # the head (no decay, lr x 1) shares the biases and norms' kernel call
