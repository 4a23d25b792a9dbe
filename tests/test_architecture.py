"""Which module may import which. The folders show the processes: services/worker runs in
a training worker, services/server only in a state server, and neither imports the other;
the folders both use (core, segments, tiers, checkpoint, transport, metrics, data,
models) import neither. The core (services/core and the tiers' math) imports neither Ray
nor gRPC, the config schema imports only the core, nothing below the Python API imports
it, and no module-level import cycle exists. The schema reaches services only through
the sections and values they read: none but the worker actor names the whole
``TrainConfig``. Checked on the source (every module's top-level imports, and every
mention of ``TrainConfig``) and in a fresh interpreter (what importing a module really
loads)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "cargohold": ROOT / "api",
    "cargohold.services": ROOT / "services",
    "cargohold.cluster": ROOT / "cluster",
}
CORE_EXTRA = frozenset(
    {
        "cargohold.services.tiers.fileformat",
        "cargohold.services.tiers.partitions",
        "cargohold.services.tiers.planner",
        "cargohold.services.tiers.residency",
    }
)
"""The tiers' pure logic (file format, partitions, planner), which the planner imports too."""
RUNTIMES = ("ray", "grpc", "grpc_health", "transformers", "prometheus_client")


def _modules() -> dict[str, Path]:
    """Every module of the two source folders, by import name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _top_level_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The cargohold modules ``path`` imports at module level (TYPE_CHECKING blocks and
    imports inside functions excluded)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            found = name
            while found and found not in known:
                found = found.rpartition(".")[0]
            if found and (found != "cargohold" or name == "cargohold"):  # cargohold.v1 is not the API root
                imported.add(found)
    return imported


PACKAGE_INITS = frozenset(name for name, path in _modules().items() if path.name == "__init__.py")
GRAPH = {name: _top_level_imports(path, _modules()) - {name} for name, path in _modules().items()}
CORE = frozenset(m for m in GRAPH if m.startswith("cargohold.services.core.")) | CORE_EXTRA
"""The pure logic (services/core/ and the tiers' math): testable without a cluster,
importable anywhere."""
WORKER = "cargohold.services.worker"
SERVER = "cargohold.services.server"
SHARED = tuple(
    f"cargohold.services.{folder}"
    for folder in ("core", "segments", "tiers", "checkpoint", "transport", "metrics", "data", "models")
)
"""What both processes may import: neither imports the worker's or the server's modules."""


def _importing(importers: str, imported: str) -> dict[str, list[str]]:
    """Modules under ``importers`` that import modules under ``imported``, with what."""
    found = {
        module: sorted(t for t in targets if t == imported or t.startswith(imported + "."))
        for module, targets in GRAPH.items()
        if module == importers or module.startswith(importers + ".")
    }
    return {module: targets for module, targets in found.items() if targets}


def _loaded_by(modules: tuple[str, ...]) -> dict[str, set[str]]:
    """What a fresh interpreter loads for each of ``modules``, imported one after another:
    the modules each import adds. One interpreter for all (torch is imported once): a
    module that loads what it must not is named as long as no module before it loaded
    the same, and one that did is named for it, so the check sees every such import."""
    code = (
        "import json, sys\n"
        "added = {}\n"
        f"for module in {list(modules)!r}:\n"
        "    before = set(sys.modules)\n"
        "    __import__(module)\n"
        "    added[module] = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(added))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return {module: set(loaded) for module, loaded in json.loads(out.stdout).items()}


def test_there_is_no_import_cycle() -> None:
    """Tarjan's strongly connected components of the module graph are all single modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_imports_only_the_core() -> None:
    assert CORE <= GRAPH.keys(), sorted(CORE - GRAPH.keys())
    outside = {module: sorted(GRAPH[module] - CORE) for module in CORE if GRAPH[module] - CORE}
    assert not outside, f"core modules importing beyond the core: {outside}"


SCHEMA = frozenset(m for m in GRAPH if m == "cargohold.cluster.schema" or m.startswith("cargohold.cluster.schema."))
"""The config schema: its dataclasses, which services may read."""


def test_the_config_schema_imports_only_the_core() -> None:
    outside = {module: sorted(GRAPH[module] - CORE - SCHEMA) for module in SCHEMA if GRAPH[module] - CORE - SCHEMA}
    assert not outside, f"schema modules importing beyond the core: {outside}"


def test_services_import_nothing_from_cluster_but_the_config_schema() -> None:
    wrong = {
        module: sorted(t for t in targets if t.startswith("cargohold.cluster.") and t not in SCHEMA)
        for module, targets in GRAPH.items()
        if module.startswith("cargohold.services.")
    }
    assert not {m: t for m, t in wrong.items() if t}


API = frozenset(name for name, path in _modules().items() if path.is_relative_to(ROOT / "api"))
"""The Python API: api/, the root package ``cargohold`` and its modules."""


def test_nothing_below_the_api_imports_it() -> None:
    """The Python API (api/) is the top layer: services and cluster stand without it."""
    wrong = {m: sorted(targets & API) for m, targets in GRAPH.items() if m not in API}
    assert not {m: t for m, t in wrong.items() if t}


def test_importing_the_package_root_loads_no_runtime() -> None:
    """``import cargohold`` is light: the API's names load torch, gRPC and Ray on first use."""
    (loaded,) = _loaded_by(("cargohold",)).values()
    assert not sorted(m for m in loaded if m.split(".")[0] in (*RUNTIMES, "torch"))


def test_the_worker_never_imports_the_servers_modules() -> None:
    assert not _importing(WORKER, SERVER)


def test_the_server_never_imports_the_workers_modules() -> None:
    assert not _importing(SERVER, WORKER)


def test_shared_folders_import_neither_process() -> None:
    """services/core, segments, tiers, checkpoint, transport, metrics, data and models run
    in either process: none of them imports services/worker or services/server."""
    wrong = {f"{folder} -> {side}": _importing(folder, side) for folder in SHARED for side in (WORKER, SERVER)}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_client_does_not_import_the_segment_store() -> None:
    """The gRPC client shares the update call and the segment's spec (services/core) with the
    server; a worker whose segments all live on state servers loads no segment store through it."""
    client = GRAPH["cargohold.services.transport.grpc_client"]
    assert not {t for t in client if t.startswith("cargohold.services.segments.")}
    assert not client & {"cargohold.services.tiers.storage", "cargohold.services.tiers.nvme"}


WHOLE_CONFIG = "TrainConfig"
TAKES_THE_WHOLE_CONFIG = frozenset({"cargohold.services.worker.actor"})
"""The one service that receives the run's whole config: the launcher sends it to each
worker actor over Ray, and the actor hands every part below it the sections it reads."""


def _mentions_of_whole_config(source: str) -> list[int]:
    """Lines of ``source`` that import ``TrainConfig``, name it in code, or annotate with
    it (quoted annotations too); docstrings and comments aside."""
    tree = ast.parse(source)
    annotations = [
        node.annotation if isinstance(node, (ast.arg, ast.AnnAssign)) else node.returns
        for node in ast.walk(tree)
        if isinstance(node, (ast.arg, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    quoted = {
        id(node)
        for annotation in annotations
        if annotation is not None
        for node in ast.walk(annotation)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name.rpartition(".")[2] for alias in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif id(node) in quoted:
            names = re.findall(r"\w+", node.value)
        else:
            continue
        if WHOLE_CONFIG in names:
            lines.add(node.lineno)
    return sorted(lines)


def test_services_take_config_sections_not_the_whole_config() -> None:
    """A service takes the sections it reads (``DataConfig``, ``WorkerConfig``, ...), the
    values, or a small record of them (``ModelSpec``, ``PortConfig``), never the whole
    ``TrainConfig``: the launcher, the plan, the CLI and the API hand them down
    (``cluster/sections.py``), and so does the worker actor, the one exception."""
    wrong = {
        module: lines
        for module, path in _modules().items()
        if module.startswith("cargohold.services.") and module not in TAKES_THE_WHOLE_CONFIG
        if (lines := _mentions_of_whole_config(path.read_text()))
    }
    assert not wrong, f"services naming the whole TrainConfig (module: lines): {wrong}"


def test_the_whole_config_check_sees_imports_and_annotations() -> None:
    """The check above catches each way a module could come to take the whole config."""
    caught = [
        "from cargohold.cluster.schema.train import TrainConfig",
        "from cargohold.cluster.schema.train import TrainConfig as Config",
        "if TYPE_CHECKING:\n    from cargohold.cluster.schema import train\ndef f(c: train.TrainConfig) -> None: ...",
        "def f(c: 'TrainConfig') -> None: ...",
        "def f() -> TrainConfig | None: ...",
        "config: TrainConfig",
        "import cargohold.cluster.schema.train\nconfig = cargohold.cluster.schema.train.TrainConfig()",
    ]
    assert [source for source in caught if not _mentions_of_whole_config(source)] == []
    passed = '"""Takes the sections of a TrainConfig."""\nfrom cargohold.cluster.schema.data import DataConfig'
    assert _mentions_of_whole_config(passed) == []


def test_only_the_launcher_imports_the_worker_actor() -> None:
    importers = {m for m, targets in GRAPH.items() if "cargohold.services.worker.actor" in targets}
    assert importers == {"cargohold.cluster.launcher"}


def test_importing_the_core_and_the_config_loads_no_runtime() -> None:
    """Checked where it counts: in a fresh interpreter, imports inside functions aside."""
    for module, loaded in _loaded_by((*sorted(SCHEMA), *sorted(CORE))).items():
        runtimes = sorted(m for m in loaded if m.split(".")[0] in RUNTIMES)
        ours = {m for m in loaded if m in GRAPH} - CORE - SCHEMA - PACKAGE_INITS - {module}
        assert not runtimes, f"importing {module} loads {runtimes[:5]}"
        assert not ours, f"importing {module} loads {sorted(ours)}"
