"""pyproject.toml lists every package folder: a folder with an ``__init__.py`` that the
list leaves out is missing from a wheel (and from a strict editable install), and a listed
package without its folder fails every install."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_exactly_the_package_folders() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    on_disk = set()
    for package, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *parts])
            # a folder another package-dir entry maps is listed under that entry's name
            mapped_elsewhere = any(
                name == other or name.startswith(other + ".") for other in package_dir if len(other) > len(package)
            )
            if not mapped_elsewhere:
                on_disk.add(name)
    listed = set(setuptools["packages"])
    assert listed == on_disk, (
        f"listed but absent: {sorted(listed - on_disk)}; on disk but not listed: {sorted(on_disk - listed)}"
    )
