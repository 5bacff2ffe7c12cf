"""A `diloco-train` job's settings: architecture, rounds, inner and outer optimizers,
compression, aggregation, and the round driver's quorum, timer and modes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from idlegrid.kinds.base import KindParams
from idlegrid.kinds.diloco import run as runner
from idlegrid.kinds.diloco.inner import InnerSettings
from idlegrid.p2p.averaging import MAX_MEMBERS
from idlegrid.training import fragments, models
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression
from idlegrid.training.fragments import Span, Streaming, StreamingSettings
from idlegrid.training.outer import OuterSettings


class PoolSettings(BaseModel):
    """The trusted nodes of a peer-to-peer job: those of these accounts or this team."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accounts: list[str] = Field(default_factory=list, max_length=1000)
    team: str | None = Field(default=None, min_length=1, max_length=100)
    # Set by the coordinator at submission: the ids of the accounts named (or of the
    # team's members then). Whatever a request puts here is replaced.
    account_ids: list[int] = Field(default_factory=list, max_length=100_000)


# Seconds a member needs to start its averaging process (torch, hivemind, the p2p daemon)
# beyond its group's two attempts: what a round's timer must leave it.
P2P_STARTUP_S = 60.0


class DilocoParams(KindParams):
    architecture: str = Field(default="transformer-lm", description="a built-in architecture")
    model: dict[str, Any] = Field(default_factory=dict, description="the architecture's config")
    rounds: int = Field(default=10, ge=1, le=100_000)
    workers: int = Field(default=4, ge=1, le=10_000, description="shards (tasks) per round")
    inner: InnerSettings = InnerSettings()
    outer: OuterSettings = OuterSettings()
    upload: Compression = Compression(method="int8")
    download: Compression = Compression(method="int8")
    aggregation: Aggregation = Aggregation()
    seed: int = Field(default=0, ge=0, lt=2**63, description="initial weights and batches")
    eval_batches: int = Field(default=16, ge=1, le=10_000)
    # For the round driver: a round closes on `min_updates` or after `round_timeout_s`.
    eval_every: int = Field(default=1, ge=1, description="rounds between held-out evaluations")
    min_updates: int | None = Field(default=None, ge=1, description="default: workers")
    round_timeout_s: float = Field(default=600.0, gt=0.0)
    asynchronous: bool = Field(
        default=False,
        description="a task still running when its round closes goes on; its update counts "
        "in the round open when it arrives, weighted (1+s)^-alpha by its staleness s",
    )
    max_staleness: int = Field(
        default=2, ge=0, le=100, description="asynchronous mode: older updates are dropped"
    )
    streaming: StreamingSettings | None = Field(
        default=None,
        description="streaming DiLoCo: the model in `fragments` blocks of layers, round t "
        "syncs fragment t mod fragments alone; the others go on training on each worker",
    )

    averaging: Literal["coordinator", "p2p"] = Field(
        default="coordinator",
        description="coordinator: every update passes through the coordinator (verified, "
        "robust aggregation; for public volunteers); p2p: the round's members average among "
        "themselves through Hivemind, for a trusted pool",
    )
    pool: PoolSettings | None = Field(
        default=None, description="p2p: the accounts or team whose nodes may join its groups"
    )
    checkpoint_every: int = Field(
        default=10, ge=1, le=100_000,
        description="p2p: rounds between uploads of the outer optimizer's state (the "
        "weights the coordinator rebuilds every round from the one published update)",
    )  # fmt: skip
    group_timeout_s: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="p2p: how long each averaging attempt waits for its group",
    )  # fmt: skip

    @model_validator(mode="after")
    def _valid_model(self) -> DilocoParams:
        self.model_settings()
        if self.min_updates is not None and self.min_updates > self.workers:
            raise ValueError(f"min_updates {self.min_updates} exceeds workers {self.workers}")
        if len(self.inner.ramp) > self.rounds:
            raise ValueError(f"inner.ramp has {len(self.inner.ramp)} rounds; the job {self.rounds}")
        if self.inner.first_step:
            raise ValueError("inner.first_step is set per task, not per job")
        if self.asynchronous and self.max_staleness < 1:
            raise ValueError("asynchronous mode needs max_staleness >= 1 (with 0 every "
                             "late update is dropped: set asynchronous=false)")  # fmt: skip
        if self.asynchronous and self.max_staleness >= self.rounds:
            raise ValueError(f"max_staleness {self.max_staleness} must be less than rounds "
                             f"{self.rounds}: no update can be that late")  # fmt: skip
        if self.streaming is not None:
            if self.architecture == "hf-causal-lm":
                raise ValueError("streaming fragments cut the built-in architectures only")
            if self.asynchronous:
                raise ValueError("streaming fragments need synchronous rounds: a late update "
                                 "would be of another fragment than the round syncs")  # fmt: skip
            self.fragments()
        if self.averaging == "p2p":
            self._valid_p2p()
        return self

    def _valid_p2p(self) -> None:
        """Settings that peer-to-peer averaging (a plain all-reduce) cannot run."""
        if self.pool is None or not (self.pool.accounts or self.pool.team):
            raise ValueError("averaging 'p2p' needs a pool: the accounts or the team whose nodes "
                             "may join its groups (all-reduce trusts every member)")  # fmt: skip
        if not 2 <= self.workers <= MAX_MEMBERS:
            raise ValueError(f"averaging 'p2p' averages exactly in groups of 2 to {MAX_MEMBERS} "
                             f"workers, not {self.workers}")  # fmt: skip
        if self.aggregation.rule != "mean":
            raise ValueError(f"averaging 'p2p' averages (mean); aggregation rule "
                             f"{self.aggregation.rule!r} needs the coordinator")  # fmt: skip
        if self.asynchronous:
            raise ValueError("averaging 'p2p' needs synchronous rounds: a group averages once")
        if self.streaming is not None:
            raise ValueError("averaging 'p2p' syncs the whole model: streaming is not supported")
        if self.min_updates is not None and self.min_updates < 2:
            raise ValueError("averaging 'p2p' needs min_updates >= 2 (a group of one averages "
                             "nothing)")  # fmt: skip
        needed = 2 * self.group_timeout_s + P2P_STARTUP_S
        if self.round_timeout_s <= needed:
            raise ValueError(f"round_timeout_s {self.round_timeout_s:g} must exceed two "
                             f"averaging attempts and a start ({needed:g} s)")  # fmt: skip

    def fragments(self) -> Streaming | None:
        """The spans and mixing of streaming DiLoCo, or None (every round syncs it all)."""
        if self.streaming is None:
            return None
        try:
            return fragments.streaming(self.architecture, self.model_settings(), self.streaming)
        except ValueError as exc:
            raise ValueError(f"streaming: {exc}") from None

    def synced(self, round_number: int) -> Span | None:
        """The fragment round `round_number` syncs, or None (the whole model)."""
        spans = self.fragments()
        return None if spans is None else spans.synced(round_number)

    def train_spec(self) -> runner.TrainSpec:
        """What every task of this job shares, for the worker side."""
        return runner.TrainSpec(
            self.architecture, self.model_settings(), self.inner, self.upload, self.eval_batches,
            outer=self.outer, download=self.download,
        )  # fmt: skip

    def model_settings(self) -> Any:
        """The validated config of the chosen architecture."""
        try:
            return models.parse_config(self.architecture, self.model)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
