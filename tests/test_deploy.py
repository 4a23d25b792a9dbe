"""deploy/: KubeRay manifests, Prometheus scrape config and the Grafana dashboard.

Structural checks only, with no Kubernetes API server: every manifest parses, names its
apiVersion, kind and metadata.name, and carries the fields KubeRay, prometheus-operator
and Grafana need; the manifests agree with each other and with the code (Ray version,
custom resources, the training config). Every PromQL expression of the dashboard is
parsed with promql-parser and may select only metrics that services/metrics/names.py exports.
"""

from __future__ import annotations

import functools
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml

from cargohold.cluster.schema.io import load_config
from cargohold.cluster.schema.run import SecurityConfig
from cargohold.services.metrics.launcher import LauncherMetrics
from cargohold.services.metrics.names import METRIC_NAMES
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.metrics.worker import WorkerMetrics

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cargohold.json"
SECRET = "cargohold-auth"
CARGOHOLD_TOKEN_ENV = "CARGOHOLD_AUTH_TOKEN"
# Series a histogram or counter adds to its name in the exposition format.
COMPANION_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
# Grafana's built-in interval variables, which are not PromQL; a real duration stands in.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")


def _documents() -> Iterator[tuple[Path, dict]]:
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


def _one(kind: str) -> dict:
    found = [doc for _, doc in _documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {KUBERAY}, found {len(found)}"
    return found[0]


def _cluster_specs() -> dict[str, dict]:
    return {"RayCluster": _one("RayCluster")["spec"], "RayJob": _one("RayJob")["spec"]["rayClusterSpec"]}


def _groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _train_config() -> tuple[dict, dict]:
    configmap = _one("ConfigMap")
    return configmap, yaml.safe_load(configmap["data"]["train.yaml"])


def _ray_pin() -> str:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"ray(\[[^]]*\])?==", d)]
    return pin.split("==")[1]


def _custom_resources(group: dict) -> dict[str, float]:
    # KubeRay passes the value to `ray start --resources`, quoted: '"{\"name\": 1}"'.
    raw = group["rayStartParams"]["resources"]
    return json.loads(raw.strip("'\"").replace('\\"', '"'))


# --- KubeRay -------------------------------------------------------------------------


def test_every_manifest_parses_and_is_named() -> None:
    docs = list(_documents())
    assert {doc["kind"] for _, doc in docs} == {"ConfigMap", "RayCluster", "RayJob", "ServiceMonitor", "PodMonitor"}
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), path
        assert doc["metadata"]["name"], path
        assert doc["metadata"]["namespace"] == "cargohold", (path, doc["kind"])
        if doc["kind"] in ("RayCluster", "RayJob"):
            assert doc["apiVersion"] == "ray.io/v1"
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_ray_cluster_spec_has_head_gpu_workers_and_state_servers(kind: str) -> None:
    spec = _cluster_specs()[kind]
    assert spec["rayVersion"] == _ray_pin(), "rayVersion must equal the ray pin in pyproject.toml"
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["rayStartParams"]["num-cpus"] == "0", "actors stay off the head"
    groups = _groups(spec)
    assert set(groups) == {"gpu-workers", "state-servers"}
    for group in [head, *groups.values()]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams values are strings"
        container = group["template"]["spec"]["containers"][0]
        assert container["name"] and container["image"]
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests["cpu"] and requests["memory"] and limits["memory"]
    for name, group in groups.items():
        assert isinstance(group["replicas"], int) and group["replicas"] >= 1, name
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
    images = {g["template"]["spec"]["containers"][0]["image"] for g in [head, *groups.values()]}
    assert len(images) == 1, f"one image for every Ray node, got {images}"


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_gpus_only_on_the_gpu_group_and_nvme_on_state_servers(kind: str) -> None:
    spec = _cluster_specs()[kind]
    groups = _groups(spec)
    gpu = groups["gpu-workers"]["template"]["spec"]["containers"][0]["resources"]
    assert int(gpu["limits"]["nvidia.com/gpu"]) >= 1
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"]
    for pod in (spec["headGroupSpec"]["template"]["spec"], groups["state-servers"]["template"]["spec"]):
        container = pod["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in container["limits"] and "nvidia.com/gpu" not in container["requests"]
    assert groups["state-servers"]["rayStartParams"]["num-gpus"] == "0"

    state_pod = groups["state-servers"]["template"]["spec"]
    mounts = {m["name"]: m for m in state_pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in state_pod["volumes"]}
    _, train = _train_config()
    assert mounts["nvme"]["mountPath"] in train["state_server"]["tier"]["nvme_paths"]
    nvme = volumes["nvme"]
    if kind == "RayCluster":
        assert nvme["hostPath"]["path"] and nvme["hostPath"]["type"] == "DirectoryOrCreate"
        env = {e["name"] for e in state_pod["containers"][0]["env"]}
        assert "POD_NAME" in env and mounts["nvme"]["subPathExpr"] == "$(POD_NAME)"
    else:
        claim = nvme["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["accessModes"] == ["ReadWriteOnce"] and claim["resources"]["requests"]["storage"]


def _secret_env(container: dict) -> dict[str, dict]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_auth_tokens_come_from_the_secret(kind: str) -> None:
    spec = _cluster_specs()[kind]
    _, train = _train_config()
    config_env = train.get("security", {}).get("auth_token_env", SecurityConfig().auth_token_env)
    assert config_env == CARGOHOLD_TOKEN_ENV, "the manifests must set the variable the launcher reads"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The launcher runs in the job's driver on the head; it hands the token to the actors.
    assert _secret_env(head)[CARGOHOLD_TOKEN_ENV] == {"name": SECRET, "key": "cargohold_token"}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        container = group["template"]["spec"]["containers"][0]
        refs = _secret_env(container)
        plain = {e["name"]: e.get("value") for e in container.get("env", [])}
        if group is not spec["headGroupSpec"]:
            assert CARGOHOLD_TOKEN_ENV not in refs, "only the head needs the state servers' token"
        if kind == "RayCluster":  # Ray's token set by hand, so any KubeRay version works
            assert plain["RAY_AUTH_MODE"] == "token"
            assert refs["RAY_AUTH_TOKEN"] == {"name": SECRET, "key": "auth_token"}
        else:  # KubeRay generates and injects Ray's token; it must know it to follow the job
            assert "RAY_AUTH_TOKEN" not in plain
    if kind == "RayJob":
        assert spec["authOptions"]["mode"] == "token"


def test_rayjob_runs_the_configmap_config_on_the_same_cluster_as_raycluster() -> None:
    job = _one("RayJob")["spec"]
    configmap, _ = _train_config()
    assert job["entrypoint"].split()[:2] == ["cargohold", "train"]
    config_path = job["entrypoint"].split("--config", 1)[1].split()[0]
    for spec in _cluster_specs().values():
        head = spec["headGroupSpec"]["template"]["spec"]
        mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "train-config")
        volume = next(v for v in head["volumes"] if v["name"] == "train-config")
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        assert config_path == f"{mount['mountPath']}/train.yaml"

    def shape(spec: dict) -> dict:
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        return {
            g.get("groupName", "head"): (
                g.get("replicas"),
                g["rayStartParams"],
                g["template"]["metadata"]["labels"],
                [(c["image"], c["resources"], c.get("ports")) for c in g["template"]["spec"]["containers"]],
            )
            for g in groups
        }

    specs = _cluster_specs()
    assert shape(specs["RayJob"]) == shape(specs["RayCluster"]), "rayjob.yaml and raycluster.yaml drifted apart"


def test_training_config_is_valid_and_fits_the_cluster(tmp_path: Path) -> None:
    configmap, _ = _train_config()
    path = tmp_path / "train.yaml"
    path.write_text(configmap["data"]["train.yaml"])
    config = load_config(path)
    groups = _groups(_cluster_specs()["RayCluster"])
    gpu, state = groups["gpu-workers"], groups["state-servers"]
    gpus = int(gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert config.worker.num_workers == gpus * gpu["replicas"]
    assert config.worker.gpus == 1 and config.worker.compute_dtype == "bfloat16"
    assert config.state_server.num_servers == state["replicas"]
    assert config.cluster.address == "auto"
    for needed, group, count in (
        (config.worker.resources, gpu, config.worker.num_workers),
        (config.state_server.resources, state, config.state_server.num_servers),
    ):
        offered = _custom_resources(group)
        for name, amount in needed.items():
            assert offered[name] * group["replicas"] >= amount * count, (name, offered)


def test_monitors_select_the_ray_pods_metrics_port() -> None:
    specs = _cluster_specs()
    for spec in specs.values():
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            assert group["rayStartParams"]["metrics-export-port"] == "8080"
            ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
            assert ports["metrics"] == 8080

    service_monitor, pod_monitor = _one("ServiceMonitor")["spec"], _one("PodMonitor")["spec"]
    assert service_monitor["selector"]["matchLabels"] == {"ray.io/node-type": "head"}
    assert [e["port"] for e in service_monitor["endpoints"]] == ["metrics"]
    assert service_monitor["namespaceSelector"]["matchNames"] == ["cargohold"]
    assert pod_monitor["namespaceSelector"]["matchNames"] == ["cargohold"]
    assert [e["port"] for e in pod_monitor["podMetricsEndpoints"]] == ["metrics"]
    selector = pod_monitor["selector"]["matchLabels"]
    assert selector.pop("ray.io/node-type") == "worker"  # a label KubeRay puts on worker pods
    for spec in specs.values():
        for group in spec["workerGroupSpecs"]:
            labels = group["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), group["groupName"]
            for label in pod_monitor["podTargetLabels"]:
                assert label.startswith("ray.io/") or label in labels, label


# --- Prometheus ----------------------------------------------------------------------


def test_prometheus_scrape_config() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"]), "job names must be unique"
    assert not any(job.get("static_configs") for job in jobs.values()), "static targets are examples, commented out"
    assert jobs["cargohold"]["file_sd_configs"], "the launcher's file_sd list is the live source"
    for job in jobs.values():
        for group in job.get("static_configs", []):
            assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in group["targets"]), group
        for sd in job.get("file_sd_configs", []):
            assert sd["files"] and all(f.endswith((".json", ".yml", ".yaml")) for f in sd["files"])


# --- Grafana -------------------------------------------------------------------------


def test_grafana_provisioning() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "cargohold.yaml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] and source["uid"]
    providers = yaml.safe_load((provisioning / "dashboards" / "cargohold.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


@functools.cache
def _histograms() -> frozenset[str]:
    registries = (StateServerMetrics("check").registry, WorkerMetrics(0).registry, LauncherMetrics().registry)
    return frozenset(
        family.name for registry in registries for family in registry.collect() if family.type == "histogram"
    )


def unknown_metrics(expr: str, *, promql: bool = True) -> list[str]:
    """The `cargohold_` names in `expr` that services/metrics/names.py does not export.

    A name counts with a companion suffix stripped: `_bucket`, `_sum`, `_count` only on a
    histogram, `_created` on a histogram or a counter (whose exported name ends `_total`).
    With `promql`, `expr` must also parse as PromQL, and every metric it selects must be
    a cargohold one.
    """
    names = set(re.findall(r"cargohold_[a-z0-9_]+", expr))
    if promql:
        tree = promql_parser.parse(GRAFANA_INTERVALS.sub("1m", expr))  # raises on bad syntax
        selected: list[str | None] = []

        def visit(node) -> None:
            if isinstance(node, promql_parser.VectorSelector):
                selected.append(
                    node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
                )

        promql_parser.walk(tree, visit)
        names |= {f"<not a cargohold metric: {n}>" for n in selected if not (n or "").startswith("cargohold_")}
    known, histograms = set(METRIC_NAMES), _histograms()
    return sorted(name for name in names if not _exported(name, known, histograms))


def _exported(name: str, known: set[str], histograms: frozenset[str]) -> bool:
    if name in known:
        return True
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            base = name.removesuffix(suffix)
            if base in histograms:
                return True
            if suffix == "_created" and f"{base}_total" in known:
                return True
    return False


def test_dashboard_parses_with_unique_panel_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for panel in _panels(dashboard):
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel.get("targets", [])]
    assert len(exprs) >= 15
    problems = {f"{title}: {expr}": bad for title, expr in exprs if (bad := unknown_metrics(expr))}
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    problems |= {query: bad for query in variables if (bad := unknown_metrics(query, promql=False))}
    assert not problems, problems
    # Every family the code exports has a panel.
    used = {name for _, expr in exprs for name in re.findall(r"cargohold_[a-z0-9_]+", expr)}
    used = {
        next((n.removesuffix(s) for s in COMPANION_SUFFIXES if n.endswith(s) and n.removesuffix(s) in METRIC_NAMES), n)
        for n in used
    }
    missing = {name for name in METRIC_NAMES if name not in used}
    assert not missing, f"no panel for {sorted(missing)}"


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ("rate(cargohold_worker_stpes_total[1m])", ["cargohold_worker_stpes_total"]),
        ("cargohold_worker_loss_bucket", ["cargohold_worker_loss_bucket"]),  # a gauge has no buckets
        ("rate(cargohold_worker_steps_created[1m])", []),  # a counter's _created, named without _total
        ("histogram_quantile(0.9, rate(cargohold_optimizer_step_seconds_bucket[$__rate_interval]))", []),
        ("rate(node_cpu_seconds_total[1m])", ["<not a cargohold metric: node_cpu_seconds_total>"]),
    ],
)
def test_the_metric_check_rejects_unknown_names(expr: str, bad: list[str]) -> None:
    assert unknown_metrics(expr) == bad


def test_the_metric_check_rejects_bad_promql() -> None:
    with pytest.raises(ValueError):
        unknown_metrics("sum(rate(cargohold_worker_steps_total[1m])")


IP_LITERAL = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")


def _uncommented(path: Path) -> str:
    """The file's text without comments (YAML '#'); JSON files have none."""
    if path.suffix == ".json":
        return path.read_text()
    return "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in path.read_text().splitlines())


def test_no_shipped_deploy_file_names_a_live_address_but_loopback() -> None:
    """A shipped config run as it is must not reach into whatever network it sits in:
    literal IPv4 addresses outside comments are loopback (or the wildcard in a bind)."""
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in (".yml", ".yaml", ".json")]
    assert any(p.name == "prometheus.yml" for p in files)
    found = {
        str(p.relative_to(REPO)): hits
        for p in files
        if (hits := [ip for ip in IP_LITERAL.findall(_uncommented(p)) if not ip.startswith("127.") and ip != "0.0.0.0"])
    }
    assert not found, f"non-loopback addresses outside comments: {found}"


def test_the_address_check_sees_live_addresses_and_skips_comments(tmp_path: Path) -> None:
    sample = tmp_path / "sample.yml"
    sample.write_text('- targets: ["10.0.0.11:41811"]  # 10.9.9.9 in a comment\n# - targets: ["10.0.0.12:1"]\n')
    assert IP_LITERAL.findall(_uncommented(sample)) == ["10.0.0.11"]
