"""Frozen settings objects, built from CLI flags over `IDLEGRID_*` environment variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from idlegrid.policy.quotas import Quotas
from idlegrid.verification.trust import TrustSettings

T = TypeVar("T")

MIB = 1024 * 1024


# How strictly the replicas of a shard must come from different networks, by name
# (`idlegrid serve --replica-networks`, docs/operations.md "Replicas and networks"):
# "distinct" (the default, for public grids): networks differ, IPv4 /24 and IPv6 /48 as
# the prefixes say; "address": each address is a network of its own (a lab whose
# machines reach the coordinator by their own addresses); "shared": no network rule (one
# machine, or nodes behind one NAT); accounts and nodes must still differ.
REPLICA_NETWORKS: dict[str, dict[str, Any]] = {
    "distinct": {"distinct_networks": True},
    "address": {"distinct_networks": True, "network_prefix_v4": 32, "network_prefix_v6": 128},
    "shared": {"distinct_networks": False},
}


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """Everything `idlegrid serve` can be told; defaults make a one-machine grid."""

    data_dir: Path = Path("./idlegrid-data")
    # Empty means SQLite in data_dir; postgresql://... for several coordinator processes.
    database_url: str = ""
    # PostgreSQL schema of the tables (made if missing); empty: the server's search path.
    database_schema: str = ""
    # Empty means the in-process broker (one coordinator); redis://... shares the ready
    # queue, presence and messages between several coordinators.
    redis_url: str = ""
    # Every Redis key starts with this, so grids (or test runs) can share one server.
    redis_prefix: str = "idlegrid:"
    host: str = "127.0.0.1"
    port: int = 8000
    max_blob_bytes: int = 256 * MIB
    max_request_bytes: int = 16 * MIB
    heartbeat_interval_s: float = 15.0
    # A node that sends nothing for this long is offline; its tasks go back to the queue.
    node_timeout_s: float = 45.0
    # The longest wait between the workers' reconnect attempts (their backoff_max_s).
    # A coordinator that (re)starts expires no task for `restart_grace_s`: its workers
    # come back within this, and reclaim what they hold.
    worker_backoff_max_s: float = 30.0
    # Lease = the shard's time on the node as the coordinator measured it (its validated
    # tasks of the kind), else the kind's default, x lease_slack; clamped to
    # [min_lease_s, max_lease_s]. What a node says of its speed never sets it.
    min_lease_s: float = 120.0
    max_lease_s: float = 6 * 3600.0
    lease_slack: float = 4.0
    # A job whose estimated time on the connected fleet (policy/sizing.py) is longer than
    # this gets a warning with the estimate at submission.
    estimate_warning_s: float = 600.0
    # A node may still read a task's blobs (and upload its output) this long after the
    # task ended or its lease ran out.
    blob_grace_s: float = 600.0
    monitor_interval_s: float = 1.0
    # One process of several runs the grid-wide passes (lease expiry, top-up, late
    # results, round timers, presence): the holder of a broker lease of this length,
    # renewed every third of it. When it dies another takes over once the lease ran out.
    leader_lease_s: float = 5.0
    # A check of an output that names its build (llm-generate) waits this long after the
    # output was made for a node of that build; then any node may check it, within the
    # cross-build margins (docs/verification.md).
    check_build_wait_s: float = 300.0
    # A checked output whose only passes are of checkers without an established record,
    # when no other volunteer's node can add one, waits this long after its shard's latest
    # result for those records (known-answer checks in other shards); then it fails.
    check_confirm_wait_s: float = 600.0
    # Tasks of one shard (all ever created: BOINC's max_total_results) before it fails.
    max_attempts: int = 10
    # Replicas per shard unless a job says otherwise; a quorum of two must agree.
    default_replication: int = 3
    # Replicas of a shard go to distinct accounts and networks (IPv4 /24, IPv6 /48), not
    # only distinct nodes. How strictly networks must differ: REPLICA_NETWORKS.
    distinct_accounts: bool = True
    distinct_networks: bool = True
    network_prefix_v4: int = 24
    network_prefix_v6: int = 48
    # Trust (verification.trust.TrustSettings): see docs/verification.md for the figures.
    prior_bad_fraction: float = 0.2
    adaptive_after: int = 80
    spot_check_rate: float = 0.08
    double_check_rate: float = 0.5
    min_credibility: float = 0.95
    initial_daily_quota: int = 50
    suspend_after_invalids: int = 3
    # Sybil limits on new nodes.
    max_nodes_per_account: int = 100
    node_registrations_per_account_per_hour: int = 20
    node_registrations_per_address_per_hour: int = 20
    # Scheduling (see docs/architecture.md, "Scheduling"): weights of the score's terms.
    sched_priority_weight: float = 1.0
    sched_age_weight: float = 1.0
    sched_age_scale_s: float = 600.0
    sched_fair_share_weight: float = 4.0
    sched_speed_weight: float = 1.0
    sched_speed_scale_s: float = 60.0
    sched_locality_weight: float = 1.0
    sched_affinity_weight: float = 1.0
    sched_reliability_weight: float = 0.5
    sched_on_time_weight: float = 1.0
    # Fair share: "account=share" entries (default share 1), and the half-life of the
    # usage (FLOPs handed out) that the shares are compared against.
    account_shares: tuple[str, ...] = ()
    fair_share_half_life_s: float = 3600.0
    # Speculative backup copies of a job's last shards: an idle node gets one when the
    # shard's holder is expected to finish more than `backup_factor` x (and
    # `backup_min_gain_s` seconds) later than the idle node would.
    backups: bool = True
    backup_factor: float = 2.0
    backup_min_gain_s: float = 5.0
    # The garbage collector (coordinator/heap.py), applied by `idlegrid serve` to its own
    # process: a young pass every gc_young_s, survivors frozen every gc_freeze_s, a full
    # pass every gc_full_s; gc_freeze_s 0: off.
    gc_young_s: float = 1.0
    gc_freeze_s: float = 30.0
    gc_full_s: float = 3600.0
    # Limits per client (docs/operations.md, "Limits"). A node socket's frames are
    # refused as they are read: past hello_max_bytes before its hello is accepted, past
    # max_frame_bytes after. Its hello must come within hello_timeout_s of opening.
    hello_max_bytes: int = 64 * 1024
    max_frame_bytes: int = 1 * MIB
    hello_timeout_s: float = 10.0
    # Node sockets not yet past their hello: in all, and from one address.
    max_pending_sockets: int = 256
    max_pending_sockets_per_address: int = 16
    # Open connections (HTTP and WebSocket) from one address; 0: no cap (set 0 behind a
    # proxy, whose address every connection has, and cap per client in the proxy).
    max_connections_per_address: int = 128
    # A request's head (request line and headers) must arrive whole within this long
    # and this size; an idle kept-alive connection closes after keep_alive_timeout_s.
    request_head_timeout_s: float = 10.0
    max_request_head_bytes: int = 64 * 1024
    keep_alive_timeout_s: float = 5.0
    # Failed authentications (unknown token) from one address within auth_failure_window_s,
    # past which that address is answered 429 until the window has room again.
    auth_failures_per_address: int = 30
    auth_failure_window_s: float = 60.0
    # Quotas of each account (admins have none): blobs it uploaded (bytes and count),
    # shards of one job, jobs queued or running, live tokens.
    quota_blob_bytes: int = 10 * 1024 * MIB
    quota_blobs: int = 10_000
    quota_shards_per_job: int = 10_000
    quota_open_jobs: int = 100
    quota_tokens: int = 200
    # A blob uploaded in chunks (POST /v1/uploads) that is not finished this long after
    # it started is forgotten (swept at the account's next upload); until then an
    # interrupted upload goes on from the bytes it has.
    blob_upload_resume_s: float = 86_400.0
    # /metrics answers these addresses (or networks, e.g. 10.0.0.0/8) and admin tokens.
    metrics_allow: tuple[str, ...] = ("127.0.0.1", "::1")
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto headers are believed: behind
    # them a client's address (for the limits above) is the one they forwarded.
    trusted_proxies: tuple[str, ...] = ("127.0.0.1",)
    # The web dashboard (src/idlegrid/dashboard): anyone may sign up when open (else an
    # operator makes accounts with `idlegrid web-account`); sessions last web_session_s.
    web_open_signup: bool = True
    web_session_s: float = 14 * 86_400.0
    # Failed sign-ins per account name from one address, and per address, within
    # web_signin_window_s, past which sign-in from that address waits (per coordinator
    # process); no limit spans addresses, so nobody can lock another person out.
    web_signin_failures_per_account: int = 5
    web_signin_failures_per_address: int = 20
    web_signin_window_s: float = 900.0
    # Bytes a researcher's uploads from the browser may take in all.
    web_upload_quota_bytes: int = 1024 * MIB
    # Build the worker wheel that /download serves when the data directory lacks this
    # version's and this install can (a source checkout, or an install from a wheel,
    # packed again): `idlegrid serve` asks for it;
    # embedded apps and tests leave it to the operator (scripts/build-downloads.sh).
    build_downloads: bool = False
    # The statistics exports (users, teams, nodes) are written this often.
    web_export_interval_s: float = 86_400.0
    # Peer-to-peer training rounds (the p2p extra, docs/training.md): "auto" runs a
    # bootstrap DHT peer in a child process if hivemind is installed, "on" insists on it,
    # "off" runs none (p2p jobs are refused). `idlegrid serve` asks for "auto". With
    # `p2p_peers` (multiaddresses of a DHT run elsewhere) nodes are sent there instead.
    p2p: str = "off"
    # The address the bootstrap DHT peer listens on; empty: the coordinator's own `host`
    # (a coordinator on 127.0.0.1 opens nothing on other interfaces).
    p2p_host: str = ""
    # 0: any free port. A fixed port (and the identity kept in the data directory) keeps
    # the addresses in tasks already handed out good across a restart.
    p2p_port: int = 0
    # The address nodes reach the DHT at, if not one of this machine's (a public IP).
    p2p_announce: str = ""
    p2p_peers: tuple[str, ...] = ()

    @property
    def restart_grace_s(self) -> float:
        """How long a (re)started coordinator waits for its workers before it expires
        tasks: a worker's longest reconnect backoff, then a node timeout (at least a
        heartbeat: the silence of a worker that is back is judged as any node's)."""
        return self.worker_backoff_max_s + max(self.node_timeout_s, self.heartbeat_interval_s)

    @property
    def p2p_listen_host(self) -> str:
        """Where the bootstrap DHT peer listens: `p2p_host`, else the coordinator's host."""
        return self.p2p_host or self.host

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite+idlegrid:///{self.data_dir / 'idlegrid.db'}"

    @property
    def trust(self) -> TrustSettings:
        return TrustSettings(
            prior_bad_fraction=self.prior_bad_fraction,
            adaptive_after=self.adaptive_after,
            spot_check_rate=self.spot_check_rate,
            double_check_rate=self.double_check_rate,
            min_credibility=self.min_credibility,
            initial_daily_quota=self.initial_daily_quota,
            suspend_after_invalids=self.suspend_after_invalids,
        )

    @property
    def quotas(self) -> Quotas:
        return Quotas(
            blob_bytes=self.quota_blob_bytes,
            blobs=self.quota_blobs,
            shards_per_job=self.quota_shards_per_job,
            open_jobs=self.quota_open_jobs,
            tokens=self.quota_tokens,
        )

    @property
    def shares(self) -> dict[str, float]:
        """Fair-share weight per account name, from `account_shares` ("alice=3")."""
        out: dict[str, float] = {}
        for entry in self.account_shares:
            name, sep, value = entry.partition("=")
            if not sep or not name.strip() or float(value) <= 0:
                raise ValueError(f"account_shares entry {entry!r}: expected name=positive number")
            out[name.strip()] = float(value)
        return out

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def download_dir(self) -> Path:
        """What /download serves: scripts/build-downloads.sh builds the packages here."""
        return self.data_dir / "downloads"

    @property
    def admin_token_file(self) -> Path:
        return self.data_dir / "admin-token"

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> CoordinatorSettings:
        """Defaults, then `IDLEGRID_<FIELD>` variables, then explicit (non-None) overrides."""
        return _from_env(cls, env, overrides)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """Everything `idlegrid worker` can be told."""

    servers: tuple[str, ...] = ("http://127.0.0.1:8000",)
    token: str = ""
    state_dir: Path = field(default_factory=lambda: Path.home() / ".idlegrid" / "worker")
    name: str = ""
    slots: int = 1
    # Tasks held beyond the slots, to start as soon as one frees: the next task's input
    # downloads while the current one computes.
    prefetch: int = 1
    # Kinds this worker offers; empty means every built-in kind it can import.
    kinds: tuple[str, ...] = ()
    device: str = ""  # empty: best available
    threads: int = 0  # torch threads per process; 0: cores / slots
    rebenchmark: bool = False
    benchmark: bool = True
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    # Simulates a slower machine (tests, benchmarks): tasks of the `sleep` kind take this
    # many times longer and the benchmark figures sent to the coordinator are divided by it.
    slowdown: float = 1.0
    # The idle policy (policy.idle; docs/worker.md). A dedicated machine computes always,
    # at full speed, whatever the probes read (tests, benchmarks, servers lent whole).
    # A task process that ran no task for this long ends, giving back the memory its
    # kinds keep (a loaded model); the next task starts a new one. 0: never.
    task_process_idle_s: float = 60.0
    dedicated: bool = False
    cpu_mode: str = "idle"  # always | idle | never
    gpu_mode: str = "idle"
    idle_after_s: float = 180.0
    cpu_cores: int = 0  # while idle; 0: all
    cpu_percent: float = 100.0
    memory_percent: float = 90.0
    in_use_cpu_cores: int = 0  # while in use (mode always)
    in_use_cpu_percent: float = 50.0
    in_use_memory_percent: float = 50.0
    suspend_cpu_usage: float = 25.0
    suspend_gpu_usage: float = 25.0  # other programs' use of a GPU the worker computes on
    exclusive_apps: tuple[str, ...] = ()
    pause_on_battery: bool = True
    min_battery_percent: float = 0.0
    windows: str = ""  # e.g. "18:00-08:00; sat,sun 00:00-24:00"
    max_cpu_temp_c: float = 0.0
    when_unknown: str = "in-use"
    # Input blobs this node downloads a day (local time), in MB; past it, it asks for no
    # work until the next day. 0: no cap.
    daily_download_mb: float = 0.0
    # Idle probes to use, by name (`idlegrid worker --show-idle` lists them); empty: all
    # of this platform's, most exact first.
    idle_probes: tuple[str, ...] = ()
    # A suspended task is given back after this long paused (or sooner, when its lease
    # could no longer be met).
    give_back_after_s: float = 600.0
    # A long task (diloco-train) saves its progress this often, to go on from there after
    # a restart or a reboot (worker/scratch.py).
    checkpoint_every_s: float = 60.0
    # The local control page on 127.0.0.1: this port, 0 any free one, -1 none.
    control_port: int = 7390
    # How this node takes part in peer-to-peer training rounds (p2p/reachability.py):
    # "public" a full peer, "client" Hivemind's client mode (behind NAT: connects out
    # only), "auto" client mode only when the DHT is public and this machine is not.
    p2p_reachability: str = "auto"
    # Sequences llm-generate decodes together in one model context (fewer where the
    # memory does not hold their KV caches); 1: one prompt after another.
    sequences: int = 32

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WorkerSettings:
        return _from_env(cls, env, overrides)


def _from_env(cls: type[T], env: Mapping[str, str] | None, overrides: Mapping[str, Any]) -> T:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = env.get(f"IDLEGRID_{f.name.upper()}")
        if raw is not None and raw != "":
            values[f.name] = _coerce(f, raw)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return cls(**values)


def _coerce(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    if "Path" in kind:
        return Path(raw)
    if "tuple" in kind:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind == "bool":
        return raw.lower() in {"1", "true", "yes", "on"}
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw
