"""SQL tables of the durable state. Alembic migrations create them; this module names them.

Times are UTC epoch seconds (float): portable across SQLite and PostgreSQL and cheap to
compare in the monitor's "due" queries.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)

metadata = MetaData()
NO_RANK = -1e18  # verification.credit.rank_key of no credit at all


def _credit_columns() -> list[Column]:  # type: ignore[type-arg]
    """Credit totals (see verification.credit): all time, and decayed with a one-week half-life."""
    return [
        Column("credit_total", Double, nullable=False, default=0.0, server_default="0"),
        Column("credit_decayed", Double, nullable=False, default=0.0, server_default="0"),
        Column("credit_updated_at", Double, nullable=False, default=0.0, server_default="0"),
        # Orders rows by recent average credit at any moment (verification.credit.rank_key).
        Column("credit_rank", Double, nullable=False, default=NO_RANK, server_default=str(NO_RANK)),
        # Results that earned credit (validated, or accepted alone from a trusted node).
        Column("validated_total", Integer, nullable=False, default=0, server_default="0"),
    ]


accounts = Table(
    "accounts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("is_admin", Boolean, nullable=False, default=False),
    Column("created_at", Double, nullable=False),
    # Set when one of the account's nodes was suspended for invalid results: a flagged
    # account registers no new nodes until an admin clears it.
    Column("flagged_at", Double, nullable=True),
    Column("flag_reason", Text, nullable=True),
    *_credit_columns(),
    # Web dashboard: who may sign in with a password, and what they may see.
    Column("email", String(254), nullable=True),
    Column("password_hash", Text, nullable=True),
    # "volunteer", "researcher" or "admin" (an admin has is_admin too). Accounts made
    # through the API are researchers, as they always were; web sign-ups are volunteers.
    Column("role", String(16), nullable=False, default="researcher", server_default="researcher"),
    Column("disabled_at", Double, nullable=True),
    Column("team_id", Integer, nullable=True),
    Index("ux_accounts_email", "email", unique=True),
    Index("ix_accounts_credit_total", "credit_total"),
    Index("ix_accounts_credit_rank", "credit_rank"),
    Index("ix_accounts_team_credit", "team_id", "credit_total"),
)

tokens = Table(
    "tokens",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("kind", String(10), nullable=False),  # "api" (researcher) or "node"
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("prefix", String(16), nullable=False),
    Column("label", String(100), nullable=False, default=""),
    Column("created_at", Double, nullable=False),
    Column("revoked_at", Double, nullable=True),
)

nodes = Table(
    "nodes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("node_key", String(64), nullable=False, unique=True),
    Column("name", String(100), nullable=False, default=""),
    Column("state", String(16), nullable=False),
    Column("worker_version", String(50), nullable=False, default=""),
    Column("hardware", JSON, nullable=False),
    Column("benchmark", JSON, nullable=False),
    Column("kinds", JSON, nullable=False),
    Column("slots", Integer, nullable=False, default=1),
    Column("address", String(64), nullable=False, default=""),
    # The address's network (IPv4 /24, IPv6 /48): replicas of a shard go to distinct ones.
    Column("network", String(64), nullable=False, default="", server_default=""),
    Column("created_at", Double, nullable=False),
    Column("last_seen_at", Double, nullable=False),
    Column("connected_seconds", Double, nullable=False, default=0.0),
    # Suspended for repeated invalid results: it gets no tasks.
    Column("suspended_at", Double, nullable=True),
    *_credit_columns(),
    Index("ix_nodes_account_created", "account_id", "created_at"),
    Index("ix_nodes_address_created", "address", "created_at"),
    Index("ix_nodes_credit_total", "credit_total"),
    Index("ix_nodes_credit_rank", "credit_rank"),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("kind", String(40), nullable=False),
    Column("params", JSON, nullable=False),
    Column("inputs", JSON, nullable=False),  # input name -> blob hash
    Column("state", String(16), nullable=False),
    Column("replication", Integer, nullable=False),
    Column("min_quorum", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("shards_total", Integer, nullable=False),
    Column("items_total", Integer, nullable=False),
    Column("result_hash", String(64), nullable=True),
    Column("result_size", Integer, nullable=True),
    Column("error", Text, nullable=True),
    Column("created_at", Double, nullable=False),
    Column("started_at", Double, nullable=True),
    Column("finished_at", Double, nullable=True),
    Index("ix_jobs_account", "account_id", "id"),
    Index("ix_jobs_state", "state"),
)

shards = Table(
    "shards",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("job_id", Integer, ForeignKey("jobs.id"), nullable=False),
    Column("idx", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("input_hash", String(64), nullable=False),
    Column("input_size", Integer, nullable=False),
    Column("item_count", Integer, nullable=False),
    Column("cost_flops", Double, nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    # Replicas wanted now and agreeing results needed: the job's replication and quorum,
    # lowered to 1 (or 2, spot-checked) when a trusted node runs the shard alone, and
    # raised back when a spot check disagrees.
    Column("target", Integer, nullable=False),
    Column("quorum", Integer, nullable=False),
    # "alone" (a trusted node runs it unreplicated), "spot" (alone, plus a spot check by
    # a second trusted node), or null (full replication).
    Column("mode", String(16), nullable=True),
    Column("canonical_task_id", Integer, nullable=True),
    Column("output_hash", String(64), nullable=True),
    Column("output_size", Integer, nullable=True),
    Column("error", Text, nullable=True),
    Column("finished_at", Double, nullable=True),
    UniqueConstraint("job_id", "idx", name="uq_shards_job_idx"),
    Index("ix_shards_state", "state"),
    Index("ix_shards_job_state", "job_id", "state"),
    # Which shards a blob is the input of: who may read it (blobs/access.py).
    Index("ix_shards_input_hash", "input_hash"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("shard_id", Integer, ForeignKey("shards.id"), nullable=False),
    Column("job_id", Integer, ForeignKey("jobs.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=True),
    Column("state", String(16), nullable=False),
    # None until verified; then "valid", "invalid" or "late" (arrived after the decision),
    # or "moot" (late, and nothing to judge it by: a check kind's other-build output).
    Column("outcome", String(16), nullable=True),
    Column("created_at", Double, nullable=False),
    Column("assigned_at", Double, nullable=True),
    Column("lease_deadline", Double, nullable=True),
    Column("finished_at", Double, nullable=True),
    Column("output_hash", String(64), nullable=True),
    Column("output_size", Integer, nullable=True),
    Column("elapsed_s", Double, nullable=True),
    Column("failure_reason", Text, nullable=True),
    # Who ran it, copied at claim time, so "one replica per account and network" is a
    # check of the shard's own rows.
    Column("account_id", Integer, nullable=True),
    Column("network", String(64), nullable=True),
    Column("backend", String(20), nullable=True),
    # Its node's llama.cpp build as the node reported it (llm-generate): a check of its
    # output goes to a node of that build (store.claims), and the output must name it.
    Column("build", String(500), nullable=True),
    # Only a trusted node may claim it (the spot check of a shard run alone).
    Column("trusted_only", Boolean, nullable=False, default=False, server_default=false()),
    # A spot check of this result (run alone) disagreed; cleared when it is judged
    # (`ledger.suspect`, `trust.after_cleared`).
    Column("suspected", Boolean, nullable=False, default=False, server_default=false()),
    # A check task (kinds verified by checks): the output it checks. NULL: it makes one.
    Column("checks_hash", String(64), nullable=True),
    # A known-answer check: the coordinator planted a defect in the output it checks,
    # so its right verdict is known ("fail"); NULL for real work. Never a shard's result.
    Column("known_answer", String(8), nullable=True),
    Column("credit", Double, nullable=True),
    Index("ix_tasks_state_lease", "state", "lease_deadline"),
    Index("ix_tasks_shard", "shard_id"),
    Index("ix_tasks_node_state", "node_id", "state"),
    Index("ix_tasks_job_state", "job_id", "state"),
    # What an account's nodes hold now: which blobs they may read and write.
    Index("ix_tasks_account_state", "account_id", "state"),
)

# Trust per node, kind and backend (verification.trust.Trust as a row) and its daily quota.
node_trust = Table(
    "node_trust",
    metadata,
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True),
    Column("kind", String(40), primary_key=True),
    Column("backend", String(20), primary_key=True),
    Column("consecutive_valid", Integer, nullable=False, default=0),
    Column("valid_total", Integer, nullable=False, default=0),
    Column("invalid_total", Integer, nullable=False, default=0),
    Column("error_total", Integer, nullable=False, default=0),
    Column("recent_invalid", Integer, nullable=False, default=0),
    Column("daily_quota", Integer, nullable=False),
    Column("suspended", Boolean, nullable=False, default=False),
    # Results of its still suspected, and the streak held meanwhile (`trust.Trust`).
    Column("suspicions", Integer, nullable=False, default=0, server_default="0"),
    Column("held_streak", Integer, nullable=False, default=0, server_default="0"),
    # Known-answer checks it answered right since its last lie (`verification.probes`).
    Column("probes_passed", Integer, nullable=False, default=0, server_default="0"),
    Column("updated_at", Double, nullable=False),
)

# Tasks a node claimed on `day` (days since the epoch, UTC), per kind and backend: its
# daily quota's count. Apart from node_trust, so a claim (which counts) and a verdict
# (which changes trust) of one node never wait for each other's row lock.
# Each start of a coordinator process, with its restart grace: a result that a start
# made late is paid by the late rule (`verification.credit.late_result_paid`).
coordinator_starts = Table(
    "coordinator_starts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("process_id", String(120), nullable=False),
    Column("started_at", Double, nullable=False),
    Column("grace_s", Double, nullable=False),
    Index("ix_coordinator_starts_started", "started_at"),
)
node_quota = Table(
    "node_quota",
    metadata,
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True),
    Column("kind", String(40), primary_key=True),
    Column("backend", String(20), primary_key=True),
    Column("day", Integer, nullable=False),
    Column("used", Integer, nullable=False),
)

# One row per round of a training job (`diloco-train`), written by the round driver.
# Round t's shards are the job's shards with idx in [first_shard, first_shard +
# train_shards), plus `eval_shard` (an evaluation of round t's weights) when it has one.
training_rounds = Table(
    "training_rounds",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("job_id", Integer, ForeignKey("jobs.id"), nullable=False),
    Column("round", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("final", Boolean, nullable=False, default=False),  # evaluation of the result only
    Column("weights_digest", String(64), nullable=False),
    Column("checkpoint_hash", String(64), nullable=False),  # safetensors of the weights
    Column("momentum_hash", String(64), nullable=False),  # outer momentum (and residual)
    # The published (compressed) update that turned the previous round's weights into these.
    Column("update_hash", String(64), nullable=True),
    Column("first_shard", Integer, nullable=False),
    Column("train_shards", Integer, nullable=False),
    Column("eval_shard", Integer, nullable=True),
    Column("opened_at", Double, nullable=False),
    Column("deadline", Double, nullable=False),
    Column("closed_at", Double, nullable=True),
    Column("metrics", JSON, nullable=False),
    UniqueConstraint("job_id", "round", name="uq_training_rounds_job_round"),
    Index("ix_training_rounds_due", "state", "deadline"),
)

# -- web dashboard ---------------------------------------------------------------------

teams = Table(
    "teams",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("description", Text, nullable=False, default=""),
    Column("founder_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("members", Integer, nullable=False, default=0),
    Column("created_at", Double, nullable=False),
    # Credit its members earned while they were members.
    *_credit_columns(),
    Index("ix_teams_credit_total", "credit_total"),
    Index("ix_teams_credit_rank", "credit_rank"),
)

# A signed-in browser: the cookie holds a random secret, this table only its SHA-256.
web_sessions = Table(
    "web_sessions",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("csrf", String(64), nullable=False),
    Column("created_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    Index("ix_web_sessions_account", "account_id"),
)

# Files a researcher uploads from the browser, chunk by chunk, into the blob store.
uploads = Table(
    "uploads",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("purpose", String(16), nullable=False),  # uploads.Purpose
    Column("size", BigInteger, nullable=False),
    Column("received", BigInteger, nullable=False, default=0),
    Column("state", String(16), nullable=False),  # UploadState: "partial" or "done"
    Column("blob_hash", String(64), nullable=True),
    Column("created_at", Double, nullable=False),
    Column("finished_at", Double, nullable=True),
    Index("ix_uploads_account", "account_id", "id"),
)

# Validated work per hour of the whole grid, and per day of each node: what the status
# page and the charts read, kept up to date by the ledger as credit is granted.
grid_hourly = Table(
    "grid_hourly",
    metadata,
    Column("hour", Integer, primary_key=True),  # hours since the epoch (UTC)
    Column("validated", Integer, nullable=False, default=0),
    Column("flops", Double, nullable=False, default=0.0),
    Column("credit", Double, nullable=False, default=0.0),
)

node_daily = Table(
    "node_daily",
    metadata,
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True),
    Column("day", Integer, primary_key=True),  # days since the epoch (UTC)
    Column("validated", Integer, nullable=False, default=0),
    Column("flops", Double, nullable=False, default=0.0),
    Column("credit", Double, nullable=False, default=0.0),
)

# -- who may read which blob -----------------------------------------------------------

# A blob belongs to every account that uploaded it (the same content may come from many).
blob_owners = Table(
    "blob_owners",
    metadata,
    Column("blob_hash", String(64), primary_key=True),
    Column("account_id", Integer, ForeignKey("accounts.id"), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("created_at", Double, nullable=False),
    Index("ix_blob_owners_account", "account_id"),
)

# Blobs a job names besides its shards' payloads: its inputs, and each training round's
# weights and published update. A node holding one of the job's tasks may read them.
job_blobs = Table(
    "job_blobs",
    metadata,
    Column("job_id", Integer, ForeignKey("jobs.id"), primary_key=True),
    Column("blob_hash", String(64), primary_key=True),
    Index("ix_job_blobs_hash", "blob_hash"),
)

# -- the volunteer's settings of each node, and what the node last said it does ----------

# One row per node and setting changed on the dashboard or reported by the node: the
# later change wins (worker/remote_settings.py), so each row says where and when.
node_settings = Table(
    "node_settings",
    metadata,
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True),
    Column("name", String(40), primary_key=True),
    Column("value", JSON, nullable=False),
    Column("source", String(8), nullable=False),  # web | local
    Column("changed_by", String(100), nullable=False, default=""),
    Column("changed_at", Double, nullable=False),
)

# What a node last said of itself: running or paused and why, its device, and why it
# could not apply the settings it was sent (empty: it applied them).
node_activity = Table(
    "node_activity",
    metadata,
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True),
    Column("state", String(16), nullable=False, default=""),
    Column("reason", String(300), nullable=False, default=""),
    Column("device", String(40), nullable=False, default=""),
    Column("settings_error", String(500), nullable=False, default=""),
    Column("updated_at", Double, nullable=False),
    # Each device as the node last said (protocol.DeviceStatus dicts); None: not said.
    Column("devices", JSON, nullable=True),
)
