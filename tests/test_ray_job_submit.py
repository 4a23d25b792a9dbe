"""`ray job submit` against a separately started Ray cluster, as an operator runs it.

A head node is started with `ray start --head --block` (job server and dashboard on
loopback, token authentication on, every port chosen free so that concurrent clusters on
the same machine do not collide). Jobs are submitted with the `ray` CLI, uploading the
repository as the working directory; the test reads the streamed output, the exit status
of `ray job submit`, and the job's status and logs from the job server's REST API.

Teardown kills exactly the processes of this cluster (the `ray start` process group and
every descendant, found through /proc) rather than running `ray stop --force`, which would
kill every Ray process on the machine, including other test runs' clusters.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_ports

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="teardown walks /proc"),
]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
# What `--working-dir .` must not upload: virtualenvs, VCS data, caches, build output, runs.
EXCLUDES = [".git", ".venv", ".hypothesis", ".pytest_cache", "*.egg-info", "__pycache__", "build", "dist", "runs"]
START_TIMEOUT_S = 90
JOB_TIMEOUT_S = 240
TINY = ["--config", "examples/tiny.yaml", "--set", "cluster.address=auto"]


@dataclass(frozen=True, slots=True)
class Head:
    dashboard: str
    """http://host:port of the dashboard, which serves the job API."""
    token: str
    env: dict[str, str]
    """Environment for `ray` CLI calls: auth mode and token, the venv's bin on PATH."""

    def api(self, path: str, method: str = "GET") -> dict | str:
        request = urllib.request.Request(
            self.dashboard + path, method=method, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read().decode()
        return json.loads(body) if reply.headers.get_content_type() == "application/json" else body


def _descendants(root: int) -> set[int]:
    """`root` and every process below it, from the parent links in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_cluster(head: subprocess.Popen) -> None:
    """SIGKILL the `ray start` process group and every descendant of it (workers, the job
    supervisor, the job's driver). Stopped first, so the raylet cannot start another
    worker between listing and killing."""
    pids = _descendants(head.pid)
    _signal_all(pids, signal.SIGSTOP)
    pids |= _descendants(head.pid)
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal_all(pids, signal.SIGKILL)
    head.wait(timeout=30)
    deadline = time.monotonic() + 15
    while (alive := {p for p in pids - {head.pid} if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes of the test cluster survived SIGKILL: {sorted(alive)}"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed, reparented process waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    temp_dir = tempfile.mkdtemp(prefix="rch", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
    )
    gcs, dashboard, client, agent_http, agent_grpc, runtime_env, metrics, node_manager, object_manager = free_ports(9)
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--num-cpus=4",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        node = Head(dashboard=f"http://127.0.0.1:{dashboard}", token=token, env=env)
        _wait_for_job_server(node, process, log_path)
        yield node
    finally:
        try:
            _kill_cluster(process)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_job_server(node: Head, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"ray start exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            node.api("/api/jobs/")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            if time.monotonic() > deadline:
                pytest.fail(f"job server not up after {START_TIMEOUT_S}s ({error}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)


def _submit(node: Head, *train_args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`ray job submit` (waiting, streaming the logs); returns its result, the job's final
    record and its logs as the job server has them."""
    submission_id = f"cargohold-test-{secrets.token_hex(4)}"
    command = [
        RAY,
        "job",
        "submit",
        "--address",
        node.dashboard,
        "--submission-id",
        submission_id,
        "--working-dir",
        ".",
        "--runtime-env-json",
        json.dumps({"excludes": EXCLUDES}),
        "--",
        "cargohold",
        "train",
        *train_args,
    ]
    try:
        result = subprocess.run(command, cwd=REPO, env=node.env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            node.api(f"/api/jobs/{submission_id}/stop", method="POST")
        finally:
            pytest.fail(f"job {submission_id} did not finish within {JOB_TIMEOUT_S}s")
    record = node.api(f"/api/jobs/{submission_id}")
    logs = node.api(f"/api/jobs/{submission_id}/logs")["logs"]
    return result, record, logs


def test_unauthenticated_requests_are_refused(head: Head) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(head.dashboard + "/api/jobs/", timeout=10)
    assert refused.value.code == 401


def test_job_trains_and_streams_progress(head: Head) -> None:
    result, record, logs = _submit(head, *TINY)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert record["status"] == "SUCCEEDED", record
    for text in (logs, result.stdout):  # the job's log file, and what `ray job submit` streamed
        losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+) step_s [0-9.]+$", text, re.M)]
        assert len(losses) == 10, text[-4000:]
        assert losses[-1] < losses[0]
        assert re.search(r"^run \S+: 10 steps, loss [0-9.]+ -> [0-9.]+, mean step [0-9.]+s$", text, re.M), text[-4000:]


def test_bad_config_fails_the_job_naming_the_key(head: Head) -> None:
    result, record, logs = _submit(head, *TINY, "--set", "optim.lrr=1")
    assert result.returncode != 0, result.stdout[-4000:]
    assert record["status"] == "FAILED", record
    assert "exit code 2" in record["message"], record  # cargohold's exit status for a bad configuration
    assert "bad configuration" in logs and "optim.lrr" in logs, logs[-4000:]
    assert "optim.lrr" in result.stdout
