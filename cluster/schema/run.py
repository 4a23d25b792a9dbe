"""The run's surroundings: the Ray cluster (``cluster.*``), checkpoints, security, metrics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cargohold.cluster.schema.checks import check_output_folder, non_negative, positive
from cargohold.cluster.schema.tuning import tuning
from cargohold.services.core.errors import ConfigError

if TYPE_CHECKING:
    from cargohold.cluster.schema.train import TrainConfig


LOCAL_STARTUP_S = 120.0
"""How long a run waits for its actors on the cluster it starts in-process: the node is
there, its resources known."""
JOINED_STARTUP_S = 1800.0
"""How long a run waits on a cluster it joins (a RayJob's, a KubeRay cluster's): nodes
may still be starting, pulling the image, or replacing a reclaimed spot node, and each
worker initialises its shard of the model."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    address: str | None = None
    """None starts a Ray cluster in-process; "auto" joins the running one (ray job submit)."""
    num_cpus: int | None = tuning(None)
    """Logical CPUs of the in-process cluster; None sizes it to fit the run."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = tuning("PACK")
    """Ray placement-group strategy over the worker and state-server bundles."""
    startup_timeout_s: float | None = tuning(None)
    """How long to wait for the placement group and every actor to be ready; None: 120 s
    for the cluster a run starts in-process, 1800 s for one it joins (`cluster.address`),
    whose nodes may still be starting, pulling images or replacing a reclaimed one
    (:attr:`startup_wait_s`)."""
    host_memory_bytes: int | None = None
    """Host RAM cargohold's processes of the run may use together (the driver, the workers,
    the state servers; each process's runtime counted; Ray's own processes, its GCS,
    raylets and agents, are not, so leave them room): one budget the planner splits. Each
    worker and state server takes what the model and config fix (lowering
    tuning.worker.weight_window and tuning.worker.exchange_slots if need be), and what is left becomes
    the state servers' RAM tier (state_server.tier.ram_budget_bytes, which must then be
    unset); a run that cannot fit it is refused before it starts. `cargohold plan` prints
    the split. null: no budget (each part as configured)."""

    @property
    def startup_wait_s(self) -> float:
        """The start-up timeout in effect: ``tuning.cluster.startup_timeout_s``, or the
        default for a cluster started in-process or joined."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return JOINED_STARTUP_S if self.address is not None else LOCAL_STARTUP_S

    def __post_init__(self) -> None:
        if self.num_cpus is not None:
            positive("tuning.cluster.num_cpus", self.num_cpus)
        if self.startup_timeout_s is not None:
            positive("tuning.cluster.startup_timeout_s", self.startup_timeout_s)
        if self.host_memory_bytes is not None:
            positive("cluster.host_memory_bytes", self.host_memory_bytes)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go (step-<N>/ folders with a manifest.json written last); None
    takes none, and then a failure cannot be recovered from."""
    every_steps: int = 0
    """Take a checkpoint every this many steps (and after the last); 0 only at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a new one lands."""
    resume: str | None = None
    """Start from "latest" (in dir) or from a checkpoint folder; None starts fresh. Keys
    of the checkpoint's config that give its state its meaning (model shape, Adam betas,
    seed and data) must be unchanged; other changed keys are logged as a warning."""
    max_failures: int = 0
    """Actor failures to recover from before the run gives up: a lost worker is replaced
    from the state servers' live state where it can be (no checkpoint read, no completed
    step computed again); otherwise everything restarts from the run's latest checkpoint,
    or from where it started when none has landed."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A checkpoint that cannot be written (its folder cannot be created, disk full,
    unwritable): stop the run with the reason (max_failures does not restart it), or log
    it and keep training (earlier checkpoints stay intact either way)."""

    def __post_init__(self) -> None:
        non_negative("checkpoint.every_steps", self.every_steps)
        positive("checkpoint.keep_last", self.keep_last)
        non_negative("checkpoint.max_failures", self.max_failures)
        if (self.every_steps or self.max_failures or self.resume == "latest") and not self.dir:
            raise ConfigError(
                "checkpoint.dir must be set for checkpoint.every_steps, checkpoint.max_failures "
                "or checkpoint.resume=latest"
            )
        if self.dir:
            check_output_folder("checkpoint.dir", self.dir)
        if self.resume not in (None, "latest") and not Path(self.resume).expanduser().is_dir():
            raise ConfigError(
                f"checkpoint.resume {self.resume!r} is not a folder: name a checkpoint folder, a folder "
                "of checkpoints, or latest (with checkpoint.dir)"
            )


TLS_FILES = ("tls.crt", "tls.key", "ca.crt")
"""What ``security.tls_dir`` holds: the certificate, its key, the CA (the names of a
Kubernetes TLS secret's keys)."""


AUTH_TOKEN_ENV = "CARGOHOLD_AUTH_TOKEN"
"""The environment variable the launcher reads the token every state-server call carries
from (in the driver's environment); unset or empty: a random token per run."""


@dataclass(kw_only=True, slots=True)
class SecurityConfig:
    """Every state-server call carries a token: the launcher reads it from
    `$CARGOHOLD_AUTH_TOKEN` in the driver's environment, or makes a random one per run, and
    hands it to the actors (no key names the variable)."""

    tls_dir: str | None = None
    """Mutual TLS between the state servers and their clients: a folder, at this path on
    every node, holding `tls.crt` (the PEM certificate each end presents; its
    subjectAltName must cover the nodes' addresses), `tls.key` (its key) and `ca.crt` (the
    CA that signed it): a Kubernetes TLS secret as cert-manager writes it, mounted as is.
    None: no TLS."""

    @property
    def auth_token_env(self) -> str:
        """The environment variable the launcher reads the token from: always
        :data:`AUTH_TOKEN_ENV`."""
        return AUTH_TOKEN_ENV

    def __post_init__(self) -> None:
        if self.tls_dir is None:
            return
        folder = Path(self.tls_dir).expanduser()
        if not self.tls_dir or not folder.is_dir():
            raise ConfigError(f"security.tls_dir {self.tls_dir!r} is not a folder (one holding {', '.join(TLS_FILES)})")
        missing = [name for name in TLS_FILES if not (folder / name).is_file()]
        if missing:
            raise ConfigError(
                f"security.tls_dir {self.tls_dir!r} holds no {', '.join(missing)} (mutual TLS reads "
                f"{', '.join(TLS_FILES)} there: a Kubernetes TLS secret's files)"
            )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    port: int | None = 0
    """Where every worker, state server and the launcher serve Prometheus metrics. 0: each
    endpoint takes a free port. Otherwise the first of a range: state server i serves on
    port + i, worker rank r on port + num_servers + r, the launcher on the port after the
    last worker's (fixed ports for Kubernetes pod monitors and static scrape configs).
    null: no metrics endpoints."""
    file_sd_path: str | None = None
    """Write the run's metrics endpoints here as a Prometheus file_sd target list
    (labels: job, run, role, index), replaced atomically when the run starts."""

    @property
    def enabled(self) -> bool:
        """Whether the run serves metrics endpoints (``metrics.port`` is not null)."""
        return self.port is not None

    def __post_init__(self) -> None:
        if not (self.port is None or self.port == 0 or 1024 <= self.port <= 65535):
            raise ConfigError(
                f"metrics.port must be null (no endpoints), 0 (any free port) or in 1024..65535, got {self.port}"
            )
        if self.port is None and self.file_sd_path is not None:
            raise ConfigError("metrics.file_sd_path lists the metrics endpoints; metrics.port null serves none")

    def port_for(self, role: str, index: int, config: TrainConfig) -> int:
        """The port an actor's endpoint binds (0 = any free port; also without endpoints)."""
        if not self.port:
            return 0
        offset = index if role == "state_server" else config.state_server.num_servers + index
        return self.port + offset  # the launcher is "worker" num_workers: the last port
