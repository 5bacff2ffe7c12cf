"""The task-kind interface: how a kind of work is split, run, compared and assembled.

A kind does no I/O of its own. The coordinator hands it the bytes of a job's input blobs
and stores what it returns; the worker hands `run` the bytes of one shard's input blob.
Heavy ML imports happen inside `run` (and helpers it calls), so importing a kind module
never imports torch.

A kind whose jobs run in rounds (training) also gives the coordinator's round driver
`RoundHooks` (its `rounds` attribute): the driver stores rounds and schedules their
shards; the kind says what a round's weights, shards and close are.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from idlegrid.blobs.files import input_hash


class InputError(ValueError):
    """A researcher's input cannot be used; the message says why (and where)."""


def required_input(inputs: Mapping[str, bytes], name: str) -> bytes:
    """Input `name`; InputError (a 422 at submission) naming it when it is missing."""
    if name not in inputs:
        raise InputError(f"missing input {name!r}")
    return inputs[name]


def required_input_hash(inputs: Mapping[str, bytes], name: str) -> str:
    """Input `name`'s SHA-256 (its store name where it came from there); InputError naming
    it when it is missing."""
    if name not in inputs:
        raise InputError(f"missing input {name!r}")
    return input_hash(inputs, name)


class WrongOutput(InputError):
    """A node's output is well formed but cannot be the right answer (NaN, all zeros, one
    value repeated): a lie, judged like a result that was outvoted, not a failure to run."""


class Verdict(enum.StrEnum):
    """Outcome of comparing two results of one shard."""

    AGREE = "agree"
    DISAGREE = "disagree"
    INCONCLUSIVE = "inconclusive"


class KindParams(BaseModel):
    """Settings of one job of a kind; each kind subclasses this with its own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Requirements:
    """What a node needs to run a shard of a kind (hard filters for the scheduler)."""

    min_memory_mb: int = 0
    # Backends the kind can use ("cpu", "cuda", "rocm", "mps"); empty means any.
    backends: frozenset[str] = frozenset()
    # Needs a GPU (of one of `backends` when those are given), with this much memory.
    accelerator: bool = False
    min_accelerator_memory_mb: int = 0
    # Minimum benchmark: dense matmul GFLOPS, and items per second of this kind where
    # the node measured it.
    min_gflops: float = 0.0
    min_kind_rate: float = 0.0
    # Free disk in the node's state directory (blob cache, model files).
    min_disk_mb: int = 0
    # ONNX Runtime execution providers the kind can use; empty means any (or none needed).
    onnx_providers: frozenset[str] = frozenset()
    # Newest default-domain ONNX opset the node's ONNX Runtime must load; 0: no need.
    min_onnx_opset: int = 0
    # Capabilities the node must offer beside the kind (listed among its kinds, e.g.
    # "p2p": it can average peer to peer).
    offers: frozenset[str] = frozenset()
    # Only nodes of these accounts (ids) may run the shards; empty: any node.
    accounts: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Pool:
    """The nodes a job's shards may go to, as its researcher named them (peer-to-peer
    training: only trusted nodes average together). The coordinator resolves the names
    at submission and refuses the job if the pool cannot hold it."""

    accounts: tuple[str, ...]
    team: str | None
    # Nodes the job needs at once (its round's members).
    members: int
    # What each node must offer beside the kind (`Requirements.offers`).
    capability: str
    # The job needs the coordinator's bootstrap DHT peer (`Swarm.peers`).
    needs_swarm: bool = True


@dataclass(frozen=True)
class ShardSpec:
    """One independent piece of a job, as produced by `split`."""

    index: int
    payload: bytes
    items: int
    cost_flops: float


@dataclass
class RunContext:
    """What the worker gives a kind's `run`: the device and a way to report progress."""

    device: str = "cpu"
    threads: int = 1
    report_progress: Callable[[float], None] = field(default=lambda fraction: None)
    is_cancelled: Callable[[], bool] = field(default=lambda: False)
    # The worker's simulated slowdown (WorkerSettings.slowdown); only `sleep` honours it.
    slowdown: float = 1.0
    # Another blob by SHA-256 through the node's blob cache (blocking; checked on arrival),
    # for kinds whose payload names blobs it may need (a training checkpoint). None: none.
    fetch: Callable[[str], bytes] | None = None
    # A directory of this task's own that outlives the worker (worker/scratch.py), where a
    # long task keeps its checkpoint every `checkpoint_every_s`. None: no checkpoints.
    scratch: Path | None = None
    checkpoint_every_s: float = 60.0
    # A check task of a kind that verifies by checking (`TaskKind.checks`): the claimed
    # output it checks. None: the task computes the shard's output.
    check: bytes | None = None
    # How a peer-to-peer training round's member joins the network (WorkerSettings).
    p2p_reachability: str = "auto"
    # Sequences a kind that decodes prompts together may run at once (WorkerSettings).
    sequences: int = 1


@dataclass(frozen=True)
class RoundPlan:
    """How a job's rounds are laid out and when they close, as the round driver needs it.

    Round t's shards have indexes t*(workers+1) + s: s < workers are its training
    shards, s = workers its evaluation (every `eval_every` rounds, and after the last).
    """

    rounds: int
    workers: int
    # A round closes on this many updates of its own, or when its timer runs out.
    min_updates: int
    round_timeout_s: float
    eval_every: int
    # Tasks still running when their round closes go on; their updates count later.
    asynchronous: bool = False
    max_staleness: int = 0
    # Shard s of the next round prefers the node whose update for shard s was taken
    # (it holds state of that shard between rounds).
    affinity: bool = False

    @property
    def stride(self) -> int:
        """Shard indexes per round: its training shards and its evaluation."""
        return self.workers + 1


@dataclass(frozen=True)
class Swarm:
    """Where a job's round members may meet to average among themselves."""

    job_id: int
    # The coordinator's bootstrap DHT peer's addresses; empty: none runs.
    peers: tuple[str, ...] = ()
    # The coordinator's round key: each round's secret derives from it (p2p/seal.py).
    key: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class RoundWeights:
    """One round's global state, as the driver stores it (blobs) and names it (digest)."""

    round: int
    digest: str
    # The weights as a result blob: the job's result once the last round closed.
    checkpoint: bytes
    # What the next close needs beside the weights (an optimizer's momentum).
    optimizer: bytes


@dataclass(frozen=True)
class Published:
    """An update the driver published: it takes round `round`'s weights (`digest`) to the
    next round's; `blob` names its bytes, which later rounds' payloads may reference."""

    round: int
    digest: str
    blob: str


@dataclass(frozen=True)
class RoundClose:
    """What closing a round produced: the next round's weights and the update to publish."""

    weights: RoundWeights
    update: bytes
    train_loss: float
    # The largest distance of an update to the round's aggregate (poisoning shows here).
    max_suspicion: float
    # Updates of earlier rounds counted in this close (asynchronous mode).
    stale_applied: int
    # Bytes the round's tasks fetched beyond their payloads (weights, updates).
    fetched_bytes: int
    # What else the round's metrics should show (how its members averaged, and why a
    # round fell back to another way); plain JSON values.
    notes: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Evaluation:
    """An evaluation shard's output, read: the held-out loss and what the task fetched."""

    loss: float
    fetched_bytes: int


class RoundJob(ABC):
    """One job of a round kind, set up once from its settings and inputs."""

    plan: RoundPlan

    @abstractmethod
    def initial(self) -> RoundWeights:
        """Round 0's weights (its training shards came from the kind's `split`)."""

    @abstractmethod
    def first_shards(self, start: RoundWeights, *, keyframe: str) -> list[ShardSpec]:
        """Round 0's shards beyond those `split` made (its evaluation, if any);
        `keyframe` names the stored checkpoint of `start`."""

    @abstractmethod
    def close(self, checkpoint: bytes, optimizer: bytes, outputs: Sequence[bytes]) -> RoundClose:
        """Close the round stored as (`checkpoint`, `optimizer`) on its accepted training
        outputs (fresh and, asynchronous, late ones): aggregate and step the weights."""

    @abstractmethod
    def shards(
        self,
        weights: RoundWeights,
        *,
        published: Sequence[Published],
        keyframe: str,
        final: bool,
    ) -> list[ShardSpec]:
        """The shards of the round `weights` opens: training (unless `final`) and its
        evaluation. `published`: every update published so far, oldest first."""

    @abstractmethod
    def evaluation(self, output: bytes) -> Evaluation:
        """Read an evaluation shard's output."""


class RoundHooks(ABC):
    """What a kind whose jobs run in rounds gives the coordinator's round driver."""

    @abstractmethod
    def job(
        self, params: KindParams, inputs: Mapping[str, bytes], *, swarm: Swarm | None = None
    ) -> RoundJob:
        """One job's rounds, from its settings and the bytes of its input blobs; `swarm`:
        where its members may average peer to peer (None: nowhere)."""


class Cancelled(Exception):
    """Raised by `run` when the worker cancelled the task while it ran."""


class TaskKind(ABC):
    """One built-in kind of work. Subclasses are stateless singletons."""

    name: ClassVar[str]
    params_model: ClassVar[type[KindParams]]
    # Names of the job's input blobs this kind expects, e.g. ("texts",).
    input_names: ClassVar[tuple[str, ...]]
    # Inputs a job may add, as its settings need them (e.g. a training job's own model).
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    result_media_type: ClassVar[str] = "application/octet-stream"
    # Replicas per shard when a job does not say; None: the grid's default (3).
    default_replication: ClassVar[int | None] = None
    # Speed (GFLOPS of a shard's nominal cost) the coordinator assumes of a node it has
    # not yet timed on this kind, for its leases: a slow machine's.
    default_gflops: ClassVar[float] = 1.0
    # The share of a node's benchmarked matmul GFLOPS (its `Benchmark.matmul_gflops`)
    # that this kind's tasks reach in FLOP/s of their nominal cost: a node's speed for the
    # kind before the coordinator has timed it (policy/sizing.py), for estimates only.
    benchmark_share: ClassVar[float] = 0.25
    # Whether a node may hold a task of this kind in its buffer (`--prefetch`), beyond
    # its slots. False where a job's shards must run side by side (a training round):
    # one node buffering a round's shards would leave other nodes idle and the round
    # waiting on it.
    buffered: ClassVar[bool] = True
    # Whether a straggling shard of this kind may get a backup copy on a faster node.
    # False where the job has its own answer to stragglers (a training round's timer and
    # quorum) and a copy would let one node's result count twice in one aggregate.
    backups: ClassVar[bool] = True
    # Kinds whose jobs run in rounds (the coordinator's round driver runs them): their
    # hooks. None: a job is its shards from `split`, assembled once all are done.
    rounds: ClassVar[RoundHooks | None] = None
    # Whether `run` keeps state in its task process that a later task uses (a training
    # run's optimizer moments): the worker then keeps an idle process instead of ending
    # it to give its memory back.
    holds_state: ClassVar[bool] = False
    # Kinds verified by a check task on another node instead of by replicas (an output
    # much cheaper to check than to make): a shard's first task makes the output, a later
    # one checks it (`RunContext.check`) and answers with a verdict (`check_verdict`).
    checks: ClassVar[bool] = False
    # Of such kinds, those whose outputs name the build that made them (`claimed_build`)
    # and whose checks are exact only on that build: a check goes to a node of the build
    # the output's node reported, and only such a check can pass it (store.check_routing).
    names_builds: ClassVar[bool] = False
    # Whether `run` computes faster on a GPU where the node has one (torch, ONNX Runtime,
    # llama.cpp): the worker places such a task on a free GPU slot before a CPU slot.
    uses_gpu: ClassVar[bool] = False

    def parse_params(self, raw: Mapping[str, object] | None) -> KindParams:
        """Validate a job's settings for this kind (raises pydantic.ValidationError)."""
        return self.params_model.model_validate(dict(raw or {}))

    def pool(self, params: KindParams) -> Pool | None:
        """The nodes this job is restricted to, by name; None: any node that fits."""
        return None

    def with_pool(self, params: KindParams, account_ids: frozenset[int]) -> KindParams:
        """The job's settings with its pool resolved to account ids (at submission)."""
        return params

    def derive_params(self, inputs: Mapping[str, bytes], params: KindParams) -> KindParams:
        """Settings that follow from the inputs, fixed once at submission and stored with
        the job, so that `requirements(params)` needs no blob (e.g. a model's size)."""
        return params

    def builtin_inputs(self, items: int | None = None) -> dict[str, bytes] | None:
        """Inputs made of data shipped with idlegrid (about `items` items where the kind
        counts them), for a benchmark or the dashboard's built-in choice; None: none."""
        return None

    @abstractmethod
    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        """Cut a job's inputs into shards; raise InputError on unusable input."""

    def requirements(self, params: KindParams) -> Requirements:
        """Hardware a node needs to run a shard of this job."""
        return Requirements()

    def work_stages(
        self, params: KindParams, shard_costs: Sequence[float], replication: int
    ) -> list[list[float]]:
        """The job's tasks as stages run one after another, each the nominal costs (FLOPs)
        of tasks that may run at once: by default one stage of every shard's `replication`
        tasks (of a kind verified by checks: its outputs; a check is a prefill pass)."""
        copies = 1 if self.checks else max(1, replication)
        return [[cost for cost in shard_costs for _ in range(copies)]]

    def cut(self, params: KindParams, max_cost: float) -> KindParams | None:
        """Settings that cut the job into shards of at most `max_cost` FLOPs where they
        can be (the job is split again with them); None: this kind's shards are as its
        settings make them, and only other settings make them smaller."""
        return None

    def describe_shard(self, spec: ShardSpec, params: KindParams) -> tuple[str, str]:
        """A shard in the researcher's words, for a refusal: what it is, and which
        settings make it smaller."""
        return f"shard {spec.index} ({spec.items:,} items)", "make the job's shards smaller"

    @abstractmethod
    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        """Worker side: compute one shard's output from its input payload."""

    @abstractmethod
    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        """Fuzzy comparison of two outputs of the same shard."""

    @abstractmethod
    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        """Build the job's result from the canonical outputs, in shard order."""

    def assemble_with_inputs(
        self, payloads: Sequence[bytes], outputs: Sequence[bytes], params: KindParams
    ) -> bytes:
        """`assemble`, for kinds whose shards say where their rows go (payloads in shard order)."""
        return self.assemble(outputs, params)

    def claimed_build(self, output: bytes) -> str:
        """For a kind that `names_builds`: the build a shard's output names ("" if none)."""
        return ""

    def check_verdict(self, output: bytes) -> tuple[str, bool] | None:
        """For a kind that `checks`: (SHA-256 of the claimed output, whether it passed) if
        `output` is a check task's verdict; None if it is a shard's output."""
        return None

    def check_decides(self, output: bytes) -> bool:
        """For a kind that `checks`: whether a check task's verdict decides anything (a
        pass within margins too wide for the tokens it covered proves nothing)."""
        return True

    def plant_defect(self, output: bytes, draw: float) -> bytes | None:
        """For a kind that `checks`: `output` with a defect planted that an honest check
        fails and only running the model finds (a known-answer check,
        `verification.probes`); `draw` in [0, 1) picks which. None: the kind has none."""
        return None

    def check_output(  # noqa: B027 - an optional hook: accepting everything is the default
        self, payload: bytes, output: bytes, params: KindParams
    ) -> None:
        """Cheap structural check of an output before it is accepted (raise InputError)."""
