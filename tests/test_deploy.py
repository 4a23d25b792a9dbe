"""deploy/: KubeRay manifests, Prometheus scrape config and the Grafana dashboard.

Structural checks only, with no Kubernetes API server: every manifest parses, names its
apiVersion, kind and metadata.name, and carries the fields KubeRay, prometheus-operator
and Grafana need; the manifests agree with each other and with the code (Ray version,
custom resources, the training config). Every PromQL expression of the dashboard is
parsed with promql-parser and may select only metrics that services/metrics/names.py exports.

deploy/kuberay holds two examples: the main one (configmap.yaml, raycluster.yaml,
rayjob.yaml) and the spot variant (the *-spot.yaml files: GPU workers on spot nodes
whose preStop hook passes the preemption notice to the workers).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml

from cargohold.cluster.schema.io import load_config
from cargohold.cluster.schema.run import SecurityConfig
from cargohold.cluster.schema.train import TrainConfig
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
# The spot variant's files: raycluster-spot.yaml, configmap-spot.yaml, checkpoints-spot.yaml.
SPOT_SUFFIX = "-spot"
# Node labels that put a pod on spot (preemptible) capacity: GKE, EKS managed node
# groups, Karpenter, AKS.
SPOT_LABELS = {
    "cloud.google.com/gke-spot": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
# The process title Ray gives every training worker: ray::<the actor class's name>
# (ray::<name>.<method> while it runs one); the spot preStop hook signals it.
WORKER_TITLE = "ray::TrainingWorker"


def _documents() -> Iterator[tuple[Path, dict]]:
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


def _is_spot(path: Path) -> bool:
    return path.stem.endswith(SPOT_SUFFIX)


def _one(kind: str, *, spot: bool = False) -> dict:
    """The one `kind` of the main example, or with `spot` of the spot variant."""
    found = [doc for path, doc in _documents() if doc["kind"] == kind and _is_spot(path) == spot]
    where = f"{KUBERAY}/*{SPOT_SUFFIX}.yaml" if spot else f"{KUBERAY} (but *{SPOT_SUFFIX}.yaml)"
    assert len(found) == 1, f"expected one {kind} in {where}, found {len(found)}"
    return found[0]


def _cluster_specs() -> dict[str, dict]:
    return {"RayCluster": _one("RayCluster")["spec"], "RayJob": _one("RayJob")["spec"]["rayClusterSpec"]}


def _groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _spot_spec() -> dict:
    return _one("RayCluster", spot=True)["spec"]


# The Ray clusters the structural tests run on: raycluster.yaml, rayjob.yaml's and the spot one.
VARIANTS = ["RayCluster", "RayJob", "spot"]


def _spec(variant: str) -> dict:
    return _spot_spec() if variant == "spot" else _cluster_specs()[variant]


def _train_config(*, spot: bool = False) -> tuple[dict, dict]:
    configmap = _one("ConfigMap", spot=spot)
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
    assert {doc["kind"] for _, doc in docs} == {
        "ConfigMap",
        "RayCluster",
        "RayJob",
        "ServiceMonitor",
        "PodMonitor",
        "PersistentVolumeClaim",
    }
    names = [(doc["kind"], doc["metadata"]["name"]) for _, doc in docs]
    assert len(names) == len(set(names)), f"two objects of one kind share a name: {sorted(names)}"
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), path
        assert doc["metadata"]["name"], path
        assert doc["metadata"]["namespace"] == "cargohold", (path, doc["kind"])
        if doc["kind"] in ("RayCluster", "RayJob"):
            assert doc["apiVersion"] == "ray.io/v1"
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"


@pytest.mark.parametrize("kind", VARIANTS)
def test_ray_cluster_spec_has_head_gpu_workers_and_state_servers(kind: str) -> None:
    spec = _spec(kind)
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


@pytest.mark.parametrize("kind", VARIANTS)
def test_gpus_only_on_the_gpu_group_and_nvme_on_state_servers(kind: str) -> None:
    spec = _spec(kind)
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
    _, train = _train_config(spot=kind == "spot")
    assert mounts["nvme"]["mountPath"] in train["state_server"]["tier"]["nvme_paths"]
    nvme = volumes["nvme"]
    if kind in ("RayCluster", "spot"):
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


@pytest.mark.parametrize("kind", VARIANTS)
def test_auth_tokens_come_from_the_secret(kind: str) -> None:
    spec = _spec(kind)
    _, train = _train_config(spot=kind == "spot")
    assert "auth_token_env" not in train.get("security", {}), "no key names the variable (it is fixed)"
    assert SecurityConfig().auth_token_env == CARGOHOLD_TOKEN_ENV, "the manifests set the variable the launcher reads"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The launcher runs in the job's driver on the head; it hands the token to the actors.
    assert _secret_env(head)[CARGOHOLD_TOKEN_ENV] == {"name": SECRET, "key": "cargohold_token"}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        container = group["template"]["spec"]["containers"][0]
        refs = _secret_env(container)
        plain = {e["name"]: e.get("value") for e in container.get("env", [])}
        if group is not spec["headGroupSpec"]:
            assert CARGOHOLD_TOKEN_ENV not in refs, "only the head needs the state servers' token"
        if kind in ("RayCluster", "spot"):  # Ray's token set by hand, so any KubeRay version works
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
    _assert_config_fits(tmp_path, *_train_config(), _cluster_specs()["RayCluster"])


def _assert_config_fits(tmp_path: Path, configmap: dict, train: dict, spec: dict) -> TrainConfig:
    """`configmap`'s train.yaml loads with cargohold's own loader and fits `spec`'s groups."""
    assert "tuning" not in train, "no shipped config sets a tuning value (tests/test_tuning.py)"
    path = tmp_path / "train.yaml"
    path.write_text(configmap["data"]["train.yaml"])
    config = load_config(path)
    groups = _groups(spec)
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
    return config


# --- the spot variant: GPU workers on spot nodes, the rest on stable ones ------------


def _pod(group: dict) -> dict:
    return group["template"]["spec"]


def _spot_selection(pod: dict) -> dict[str, str]:
    """The spot labels `pod`'s nodeSelector asks for."""
    return {k: v for k, v in pod.get("nodeSelector", {}).items() if SPOT_LABELS.get(k) == v}


def _excludes(pod: dict, key: str, value: str) -> bool:
    """Whether `pod`'s required node affinity keeps it off nodes labelled key=value: every
    term (the terms are ORed) rules the label out."""
    affinity = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not affinity:
        return False

    def rules_out(expression: dict) -> bool:
        return expression["key"] == key and (
            expression["operator"] == "DoesNotExist"
            or (expression["operator"] == "NotIn" and value in expression["values"])
        )

    return all(any(map(rules_out, term.get("matchExpressions", []))) for term in affinity["nodeSelectorTerms"])


def test_spot_gpu_workers_run_on_spot_nodes_and_the_rest_stays_off_them() -> None:
    spec = _spot_spec()
    groups = _groups(spec)
    gpu = groups["gpu-workers"]
    pod = _pod(gpu)
    ((key, value),) = _spot_selection(pod).items()  # exactly one spot label
    tolerations = pod["tolerations"]
    assert any(
        t["key"] == key
        and t["effect"] == "NoSchedule"
        and (t["operator"] == "Exists" or (t["operator"] == "Equal" and t["value"] == value))
        for t in tolerations
    ), f"the GPU pods must tolerate the spot pool's taint {key}"
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in tolerations)
    # Several smaller pods: one reclaim loses some of the workers, not all.
    assert gpu["replicas"] >= 2 and gpu["minReplicas"] == gpu["replicas"]

    for name, group in (("head", spec["headGroupSpec"]), ("state-servers", groups["state-servers"])):
        stable = _pod(group)
        assert stable.get("nodeSelector"), f"{name}: pinned to the stable pool"
        assert not _spot_selection(stable), f"{name} selects spot nodes"
        assert not any(t["key"] in SPOT_LABELS for t in stable.get("tolerations", [])), f"{name} tolerates spot"
        assert _excludes(stable, key, value), f"{name} must be kept off nodes labelled {key}={value}"


def _prestop_commands(container: dict) -> list[list[str]]:
    """The commands of `container`'s preStop exec hook, a `/bin/sh -c` script of simple
    commands separated by ';' or new lines, each split as the shell splits it."""
    hook = container.get("lifecycle", {}).get("preStop", {}).get("exec")
    assert hook, f"{container['name']}: no preStop exec hook"
    command = hook["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3, command
    return [shlex.split(part) for part in re.split(r"[;\n]", command[2]) if part.strip()]


def test_spot_gpu_workers_pass_the_preemption_notice_to_the_workers() -> None:
    spec = _spot_spec()
    groups = _groups(spec)
    pod = _pod(groups["gpu-workers"])
    for container in pod["containers"]:
        commands = _prestop_commands(container)
        signals = [c for c in commands if c[0] == "pkill"]
        sleeps = [c for c in commands if c[0] == "sleep"]
        assert len(signals) == 1 and sleeps, f"preStop: one pkill, then a sleep: {commands}"
        assert commands.index(signals[0]) < commands.index(sleeps[0]), "the signal goes first, then the wait"
        # Before the signal, the pod's Ray node is drained for preemption, so that the
        # replacements are not started on it (tests/test_multinode_recovery.py).
        drains = [c for c in commands if c[:2] == ["ray", "drain-node"]]
        assert len(drains) == 1 and commands.index(drains[0]) < commands.index(signals[0]), commands
        (drain,) = drains
        options = dict(zip(drain[2::2], drain[3::2], strict=True))
        assert options["--reason"] == "DRAIN_NODE_REASON_PREEMPTION", drain
        assert "--node-id" not in options, "the node the hook runs on"
        (pkill,) = signals
        assert pkill[1:-1] == ["-TERM", "-f"], f"SIGTERM, matched on the whole command line: {pkill}"
        pattern = re.compile(pkill[-1])  # pkill's POSIX extended regex; these read the same in Python
        assert pkill[-1] == f"^{re.escape(WORKER_TITLE)}", f"anchored on exactly the workers' title: {pkill}"
        assert pattern.search(WORKER_TITLE) and pattern.search(f"{WORKER_TITLE}.train_step")
        for other in ("ray::StateServer", "ray::StateServer.push", "ray::IDLE", "raylet --node_id=x", "python"):
            assert not pattern.search(other), other
        # pkill would match the shell running the hook, whose command line holds the
        # pattern, and end it: the wait would never happen.
        assert not pattern.search(" ".join(container["lifecycle"]["preStop"]["exec"]["command"]))
        sleep_s = sum(float(c[1]) for c in sleeps)
        grace = pod["terminationGracePeriodSeconds"]
        assert isinstance(grace, int) and grace > sleep_s > 0, (grace, sleep_s)
        assert int(options["--deadline-remaining-seconds"]) == grace, "Ray is told when the pod is killed"
    for name, group in (("head", spec["headGroupSpec"]), ("state-servers", groups["state-servers"])):
        for container in _pod(group)["containers"]:
            hooks = json.dumps(container.get("lifecycle", {}))
            assert "kill" not in hooks and "TrainingWorker" not in hooks, f"{name} must not signal workers"


def test_the_hook_signals_the_title_ray_gives_the_training_workers() -> None:
    """Ray titles an actor's process ray::<its class's __name__> (ray::<name>.<method>
    while it runs a method); the launcher starts TrainingWorker as the worker actor. A
    renamed class needs the spot manifest's preStop hook (WORKER_TITLE) renamed too."""
    from cargohold.cluster.launcher import TrainingSession
    from cargohold.services.worker.actor import TrainingWorker

    assert "ray.remote(TrainingWorker)" in inspect.getsource(TrainingSession.new_workers)
    assert f"ray::{TrainingWorker.__name__}" == WORKER_TITLE


def test_spot_training_config_fits_recovers_live_and_checkpoints_on_a_shared_volume(tmp_path: Path) -> None:
    from cargohold.cluster.live_recovery import live_refusal

    spec = _spot_spec()
    configmap, train = _train_config(spot=True)
    config = _assert_config_fits(tmp_path, configmap, train, spec)
    groups = _groups(spec)
    assert config.worker.num_workers > int(
        _pod(groups["gpu-workers"])["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    ), "the workers span several GPU pods"
    assert live_refusal(config) is None, "a reclaimed worker must be replaceable from the servers' live state"
    assert config.checkpoint.dir and config.checkpoint.every_steps > 0
    assert config.checkpoint.max_failures >= 2, "a reclaim can cost a failure; a lost server restarts"

    # The head mounts this config, and the head (the launcher: manifests) and every state
    # server (their partition files) mount one shared claim holding checkpoint.dir.
    head = _pod(spec["headGroupSpec"])
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["train-config"]["configMap"]["name"] == configmap["metadata"]["name"]
    claim = _one("PersistentVolumeClaim", spot=True)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["resources"]["requests"]["storage"]
    for name, pod in (("head", head), ("state-servers", _pod(groups["state-servers"]))):
        pod_volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [
            m
            for m in pod["containers"][0]["volumeMounts"]
            if pod_volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        ]
        assert any(Path(config.checkpoint.dir).is_relative_to(m["mountPath"]) for m in mounts), name
    # Guaranteed QoS for the state servers: requests equal limits.
    resources = _pod(groups["state-servers"])["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]


def test_monitors_select_the_ray_pods_metrics_port() -> None:
    specs = {**_cluster_specs(), "spot": _spot_spec()}
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
