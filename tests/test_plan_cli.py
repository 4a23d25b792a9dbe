"""`cargohold plan` as a command: the table it prints, its exit codes (0 fits, 3 does
not, 2 for a bad config or cluster) and JSON, and the shipped plan examples (13B on one
24 GiB GPU, 70B on eight) with the figures their comments and the docs quote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cargohold.cluster import cli
from cargohold.cluster.plan.command import EXIT_DOES_NOT_FIT
from cargohold.cluster.plan.description import ClusterDescription, load_cluster
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.sizes import format_bytes
from tests.plans import nvme_tier
from tests.reference import tiny_config

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


# --- the table -----------------------------------------------------------------------------
def test_render_shows_every_tier_and_the_verdict(tmp_path: Path) -> None:
    config = tiny_config(state_server__tier=nvme_tier(tmp_path))
    text = render(plan_run(config, ClusterDescription(nvme_bytes=1 << 30)))
    for needle in (
        "Each worker",
        "Each state server",
        "state on NVMe",
        "NVMe writes",
        "push",
        "fetch",
        "activations (estimate)",
        "fits          NVMe of state server 0",
        "=> fits",
    ):
        assert needle in text, needle


def test_the_host_budget_says_it_leaves_out_rays_own_processes() -> None:
    # Issue 40 row 16: Ray's GCS, dashboard, raylets and agents are outside the budget; the
    # plan says so, with their measured size, in its budget section and its check.
    text = render(plan_run(tiny_config(cluster__host_memory_bytes=8 * GiB)))
    budget = text[text.index("Host budget (") :].split("\n\n")[0]
    assert "Host budget (cluster.host_memory_bytes 8 GiB, cargohold's processes of the run)" in budget
    assert "counts: the driver, the workers and the state servers, each with its runtime" in budget
    assert "leaves out: Ray's own processes, about 380 MiB on the head node (GCS, dashboard, raylet, agents)" in budget
    assert "200 MiB on each other node" in budget and "measured (PSS)" in budget
    assert "host budget (cluster.host_memory_bytes), cargohold's processes (not Ray's own)" in text


# --- the command ---------------------------------------------------------------------------
@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("model: {n_layer: 2, n_head: 2, n_embd: 64, block_size: 32}\ndata: {corpus_bytes: 100000}\n")
    return path


def test_cli_exits_0_when_it_fits(tiny_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), "--host-memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits          host RAM per node" in out and "=> fits" in out


def test_cli_exits_3_when_it_does_not_fit(tiny_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), "--host-memory", "1MiB"]) == EXIT_DOES_NOT_FIT == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT  host RAM per node" in out and "=> does not fit" in out


def test_cli_json(tiny_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--config",
        str(tiny_yaml),
        "--json",
        "--device-memory",
        "1KiB",
        "--nvme",
        "1TB",
        "--set",
        "worker.gpus=1",
        "--set",
        "state_server.tier.ram_budget_bytes=327680",
        "--set",
        "tuning.state_server.tier.partition_bytes=65536",
        "--set",
        f"state_server.tier.nvme_paths=[{tmp_path / 'nvme'}]",
    ]
    assert cli.main(args) == 3
    data = json.loads(capsys.readouterr().out)
    expected = plan_run(*_cli_config(tiny_yaml, args))
    assert data["fits"] is False
    assert data["worker"]["buffers"] == expected.worker.buffers
    assert data["worker"]["device_peak_bytes"] == expected.worker.device_peak_bytes
    assert data["servers"][0]["nvme_file_bytes"] == expected.servers[0].nvme_file_bytes > 0
    assert data["servers"][0]["ram_peak_bytes"] == expected.servers[0].ram_peak_bytes
    checks = {c["resource"]: c for c in data["checks"]}
    assert checks["device memory per worker"]["fits"] is False
    assert checks["NVMe of state server 0"]["fits"] is True


def _cli_config(path: Path, args: list[str]):
    from cargohold.cluster.schema.io import load_config

    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = load_config(path, overrides)
    return config, ClusterDescription(device_memory_bytes=1024, nvme_bytes=10**12)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host-memory", "24GB!"], "cannot read '24GB!' as a size"),
        (["--device-memory", "eighty"], "--device-memory"),
        (["--set", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["--set", "state_server.num_servers=100000"], "use fewer state servers"),
        (["--cluster", "/nonexistent/cluster.yaml"], "cannot read cluster file"),
    ],
)
def test_cli_exits_2_on_a_bad_config(
    tiny_yaml: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli.main(["plan", "--config", str(tiny_yaml), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cargohold: bad configuration:") and message in err


# --- the shipped examples (plans, no run) ----------------------------------------------------
EXAMPLES = {
    # config: (cluster flags, workers, parameters)
    "examples/llama-13b-1gpu.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "256GiB", "--nvme", "2TiB"],
        1,
        13_015_864_320,
    ),
    "examples/llama-2-70b-8gpu.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "768GiB", "--nvme", "1TiB"],
        8,
        68_976_648_192,
    ),
    # Weights on NVMe: the same models on nodes with little RAM (issue 23).
    "examples/llama-13b-1gpu-32gib.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "32GiB", "--nvme", "1TiB"],
        1,
        13_015_864_320,
    ),
    "examples/llama-2-70b-8gpu-128gib.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "128GiB", "--nvme", "1TiB"],
        8,
        68_976_648_192,
    ),
    # Units below a block (worker.max_unit_params): 175B on one GPU.
    "examples/llama-175b-1gpu-256gib.yaml": (
        ["--device-memory", "24GiB", "--host-memory", "256GiB", "--nvme", "4TiB"],
        1,
        175_183_663_104,
    ),
}
WEIGHTS_IN_MEMORY = ["--set", "worker.weights_nvme_path=null", "--set", "worker.offload_params=true"]
"""What the examples with weights on NVMe need without them: the weights in pinned host RAM."""


@pytest.fixture
def at_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples name their hf config folder relative to the repository root."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("path", EXAMPLES)
def test_an_example_plan_fits_24_gib_gpus(
    at_the_repository_root, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cargohold.cluster.schema.io import load_config

    flags, workers, parameters = EXAMPLES[path]
    assert cli.main(["plan", "--config", path, *flags]) == 0
    out = capsys.readouterr().out
    assert "\n=> fits\n" in out
    config = load_config(path)
    plan = plan_run(
        config, load_cluster(None, config=config, device_memory="24GiB", host_memory=flags[3], nvme=flags[5])
    )
    w = plan.worker
    assert plan.fits and plan.parameters == parameters and plan.num_workers == workers
    assert w.device == "cuda" and w.offload and w.activation_checkpointing == "blocks"
    assert w.device_bytes == 0 and w.device_peak_bytes < 20 * GiB  # headroom for the CUDA context and allocator
    assert w.pinned_bytes == w.buffers["weights"] + w.buffers["exchange"]
    # The optimizer state: 12 B/param, in part on NVMe.
    assert sum(s.ram_state_bytes + s.nvme_state_bytes for s in plan.servers) == 12 * parameters
    assert all(s.nvme_state_bytes > 0 for s in plan.servers)
    if w.nvme_weight_bytes:  # without the weights on NVMe, host RAM is too small
        assert cli.main(["plan", "--config", path, *flags, *WEIGHTS_IN_MEMORY]) == EXIT_DOES_NOT_FIT
        assert "DOES NOT FIT  host RAM per node" in capsys.readouterr().out
        without = ["--set", "worker.weights_nvme_path=null"]
    else:
        without = ["--set", "worker.offload_params=false"]
    # Each example needs its offload: without it the GPU is too small.
    assert cli.main(["plan", "--config", path, *flags, *without]) == EXIT_DOES_NOT_FIT
    assert "DOES NOT FIT  device memory per worker" in capsys.readouterr().out
    if w.max_unit_params:  # and its units below a block
        assert cli.main(["plan", "--config", path, *flags, "--set", "worker.max_unit_params=0"]) == EXIT_DOES_NOT_FIT
        assert "DOES NOT FIT  device memory per worker" in capsys.readouterr().out
    # docs/operations.md shows this very output.
    docs = (REPO / "docs" / "operations.md").read_text()
    assert f"$ cargohold plan --config {path} {' '.join(flags)}\n{out.rstrip()}\n```" in docs, (
        "docs/operations.md shows another plan; paste the command's output"
    )


def test_the_example_figures(at_the_repository_root) -> None:
    """The figures the examples' comments and the docs quote."""
    from cargohold.cluster.schema.io import load_config

    def plan(path: str):
        flags = EXAMPLES[path][0]
        config = load_config(path)
        return plan_run(
            config, load_cluster(None, config=config, device_memory=flags[1], host_memory=flags[3], nvme=flags[5])
        )

    small, large = plan("examples/llama-13b-1gpu.yaml"), plan("examples/llama-2-70b-8gpu.yaml")
    assert format_bytes(small.worker.buffers["weights"]) == "24.2 GiB"  # the bf16 weights: the whole GPU
    assert format_bytes(small.worker.device_peak_bytes) == "9 GiB"
    assert format_bytes(small.worker.activation_bytes) == "1.78 GiB"
    assert format_bytes(large.worker.buffers["weights"]) == "16.1 GiB"  # 1/8 of the bf16 weights
    assert format_bytes(large.worker.device_peak_bytes) == "16.4 GiB"
    host = {c.resource: c for c in large.checks if c.resource.startswith("host RAM")}
    assert [format_bytes(c.need) for c in host.values()] == ["245 GiB"]
    assert format_bytes(small.worker.host_peak_bytes) == "33 GiB"  # shards + three unit-sized slots + runtime
    assert format_bytes(sum(s.nvme_state_bytes for s in large.servers)) == "724 GiB"
