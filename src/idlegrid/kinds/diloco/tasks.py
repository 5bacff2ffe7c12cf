"""The bytes of a training task and of its result: safetensors containers, no pickle.

A task payload says which weights to start from and how to get them, which data to train
on, with which seed, and in which round. Weights come in one of four ways, cheapest first:

0. an initialization seed (round 0): the worker draws the architecture's initial weights
   from it (numpy, as the coordinator did) and checks their digest; a mismatch (another
   numpy on the node) falls back to the keyframe.

1. a chain: the published updates of the last rounds (inline, or as references to their
   blobs), each with the digest of the weights it applies to. A worker holding any weights
   of the chain (by digest) applies the rest with `outer.apply_update` and checks the
   digest of the result: download compression.
2. a keyframe: a reference to the checkpoint blob of the target weights (safetensors),
   fetched through the worker's content-addressed blob cache: for a node that holds
   none of the chain's weights (it joined mid-training, or restarted).
3. inline weights (round 0, or a grid without blob references).

A result carries the compressed pseudo-gradient, a sketch of the uncompressed one (for
comparing replicas, see `verify`), the training losses, and the digest of the weights it
started from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import data as datasets
from idlegrid.p2p.group import Group, GroupError
from idlegrid.training import compression
from idlegrid.training.flat import ContainerError, digest, pack, unpack
from idlegrid.training.fragments import Streaming
from idlegrid.training.outer import apply_update

TASK_FORMAT = "idlegrid/diloco-task"
RESULT_FORMAT = "idlegrid/diloco-result"
# The outer optimizer's state of a round (momentum, download residual).
MOMENTUM_FORMAT = "idlegrid/diloco-momentum"
VERSION = 1
Mode = Literal["train", "eval"]


class MissingWeights(LookupError):
    """The worker cannot rebuild the task's starting weights from what it holds."""


@dataclass(frozen=True)
class WeightsRef:
    """Global weights of a round, named by the digest of their float32 bytes."""

    round: int
    digest: str


@dataclass(frozen=True)
class Link:
    """One published update and the weights it applies to.

    The update travels inline (`message`) or as a reference to its blob (`blob`, the
    SHA-256 of `compression.encode_message`), which a worker fetches only if it needs it.
    """

    base: WeightsRef
    message: compression.Message | None = None
    blob: str | None = None

    def __post_init__(self) -> None:
        if (self.message is None) == (self.blob is None):
            raise ValueError("a link has either an inline message or a blob reference")


@dataclass(frozen=True)
class CorpusSlice:
    """Part of the built-in corpus, so no data bytes travel: tokens [start, stop) of a split."""

    part: Literal["train", "eval"]
    start: int
    stop: int
    corpus: str = corpus.DEFAULT  # the name of a shipped corpus

    def load(self) -> datasets.TokenData:
        tokens = corpus.tokens(self.part, self.corpus)
        if not 0 <= self.start <= self.stop <= len(tokens):
            raise ContainerError(f"corpus slice {self.start}:{self.stop} of {len(tokens)}")
        return datasets.TokenData(tokens[self.start : self.stop])


DataRef = datasets.Dataset | CorpusSlice


@dataclass(frozen=True)
class TaskPayload:
    mode: Mode
    stream: str  # one training run, as the worker's caches know it (e.g. "job-17")
    round: int
    shard: int
    seed: int
    target: WeightsRef  # the weights the task starts from
    data: DataRef
    weights: np.ndarray | None = None  # the target weights inline
    keyframe_blob: str | None = None  # SHA-256 of the checkpoint of the target weights
    chain: tuple[Link, ...] = field(default=())
    init_seed: int | None = None  # the target weights are the initialization from this seed
    # Streaming DiLoCo: the fragments (a chain link of round r covers spans[r % P]), the
    # one this round syncs, and the mixing of the one synced last (`training.fragments`).
    streaming: Streaming | None = None
    # Peer-to-peer averaging (`averaging: "p2p"`): the round's group, the coordinator's
    # blob of the outer optimizer's state of the target weights (when it holds it), and
    # whether the member that reports uploads the new state (every N rounds).
    group: Group | None = None
    outer_blob: str | None = None
    report_state: bool = False


@dataclass(frozen=True)
class OuterState:
    """The outer optimizer's state that goes with the weights of digest `weights_digest`."""

    weights_digest: str
    momentum: np.ndarray
    residual: np.ndarray | None = None


@dataclass(frozen=True)
class TaskResult:
    mode: Mode
    round: int
    shard: int
    seed: int
    weights_digest: str  # the weights the task started from
    loss_first: float
    loss_mean: float
    loss_last: float
    update: compression.Message | None = None  # compressed pseudo-gradient (train)
    sketch: np.ndarray | None = None  # count sketch of the uncompressed pseudo-gradient
    # Bytes of blobs the task fetched beyond its payload (published updates, a keyframe):
    # reported by the node for the round's traffic metrics.
    fetched_bytes: int = 0
    # Peer-to-peer rounds. "p2p": the member averaged with its group (`members`) and
    # reports the digest of the mean (`averaged_digest`), of the weights after its outer
    # step (`next_digest`, empty if it holds no outer state) and its own update's norm;
    # the member that reports also carries the published update (`published`) and, every
    # N rounds or after the group changed, the new outer state (`outer`). "fallback": no
    # group formed (`reason`): it carries its own `update` for a coordinator-mode close,
    # and its outer state if it holds one.
    averaging: Literal["", "p2p", "fallback"] = ""
    averaged_digest: str = ""
    next_digest: str = ""
    update_norm: float = 0.0
    members: tuple[int, ...] = ()
    reason: str = ""
    published: compression.Message | None = None
    outer: OuterState | None = None
    # How the member took part: "public" (a full peer) or "client" (Hivemind's client
    # mode, behind NAT); "" in coordinator mode.
    reachability: Literal["", "public", "client"] = ""
    # Bytes the member sent and received in its all-reduce (every attempt), on the wire.
    wire_bytes: int = 0
    # Members its attempts could not do without (dead, unreachable, a part that did not
    # decode): named in the round's record.
    blamed: tuple[int, ...] = ()


# -- payload ----------------------------------------------------------------------------


def encode_task(task: TaskPayload) -> bytes:
    """The payload blob of a task."""
    arrays: dict[str, np.ndarray] = {}
    links = []
    for i, link in enumerate(task.chain):
        entry: dict[str, Any] = {"round": link.base.round, "digest": link.base.digest}
        if link.message is None:
            entry["blob"] = link.blob
        else:
            meta, parts = compression.to_arrays(link.message, f"chain.{i}.")
            entry.update(meta)
            arrays.update(parts)
        links.append(entry)
    if task.weights is not None:
        arrays["weights"] = np.asarray(task.weights, dtype=np.float32)
    header: dict[str, Any] = {
        "format": TASK_FORMAT,
        "version": VERSION,
        "mode": task.mode,
        "stream": task.stream,
        "round": task.round,
        "shard": task.shard,
        "seed": task.seed,
        "target": {"round": task.target.round, "digest": task.target.digest},
        "keyframe_blob": task.keyframe_blob,
        "chain": links,
        "init_seed": task.init_seed,
        "streaming": None if task.streaming is None else task.streaming.to_json(),
        "group": None if task.group is None else task.group.to_json(),
        "outer_blob": task.outer_blob,
        "report_state": task.report_state,
    }
    if isinstance(task.data, CorpusSlice):
        header["data"] = {"source": "corpus", "sha256": corpus.get(task.data.corpus).sha256,
                          "part": task.data.part, "start": task.data.start,
                          "stop": task.data.stop}  # fmt: skip
    else:
        header["data"] = {"source": "inline"}
        arrays.update(datasets.to_arrays(task.data, "data."))
    return pack(arrays, header)


def decode_task(blob: bytes) -> TaskPayload:
    """The task of a payload blob; ContainerError says what is wrong with it."""
    arrays, header = unpack(blob)
    _check_format(header, TASK_FORMAT)
    try:
        chain = tuple(_link(link, arrays, f"chain.{i}.") for i, link in enumerate(header["chain"]))
        weights = arrays.get("weights")
        if weights is not None and (weights.dtype != np.float32 or weights.ndim != 1):
            raise ContainerError("weights must be a 1-D float32 array")
        return TaskPayload(
            mode=_mode(header["mode"]),
            stream=str(header["stream"]),
            round=int(header["round"]),
            shard=int(header["shard"]),
            seed=int(header["seed"]),
            target=_ref(header["target"]),
            data=_data(header["data"], arrays),
            weights=weights,
            keyframe_blob=None
            if header.get("keyframe_blob") is None
            else str(header["keyframe_blob"]),
            chain=chain,
            init_seed=None if header.get("init_seed") is None else int(header["init_seed"]),
            streaming=None
            if header.get("streaming") is None
            else Streaming.from_json(header["streaming"]),
            group=None if header.get("group") is None else Group.from_json(header["group"]),
            outer_blob=None if header.get("outer_blob") is None else str(header["outer_blob"]),
            report_state=bool(header.get("report_state", False)),
        )
    except ContainerError:
        raise
    except GroupError as exc:
        raise ContainerError(f"task group: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ContainerError(f"malformed task header: {exc!r}") from None


def _check_format(header: Mapping[str, Any], expected: str) -> None:
    if header.get("format") != expected:
        raise ContainerError(f"not a {expected} container")
    if header.get("version") != VERSION:
        raise ContainerError(f"{expected} version {header.get('version')!r}; this is {VERSION}")


def _link(raw: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str) -> Link:
    if raw.get("blob") is not None:
        return Link(_ref(raw), blob=str(raw["blob"]))
    return Link(_ref(raw), compression.from_arrays(raw, arrays, prefix))


def _ref(raw: Mapping[str, Any]) -> WeightsRef:
    return WeightsRef(int(raw["round"]), str(raw["digest"]))


def _mode(raw: object) -> Mode:
    if raw == "train":
        return "train"
    if raw == "eval":
        return "eval"
    raise ContainerError(f"mode must be 'train' or 'eval', got {raw!r}")


def _data(raw: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> DataRef:
    if raw["source"] == "inline":
        return datasets.from_arrays(arrays, "data.")
    if raw["source"] != "corpus":
        raise ContainerError(f"unknown data source {raw['source']!r}")
    shipped = corpus.by_sha256(str(raw["sha256"]))
    if shipped is None:
        raise ContainerError("the task's corpus is none of those this worker ships")
    part = raw["part"]
    if part not in ("train", "eval"):
        raise ContainerError(f"corpus part must be 'train' or 'eval', got {part!r}")
    return CorpusSlice(part, int(raw["start"]), int(raw["stop"]), shipped.name)


def shard_ref(data: DataRef, shard: int, shards: int) -> DataRef:
    """One worker's contiguous part of the training data (a corpus slice stays a slice)."""
    if isinstance(data, CorpusSlice):
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} of {shards}")
        bounds = np.linspace(data.start, data.stop, shards + 1).astype(np.int64)
        return CorpusSlice(data.part, int(bounds[shard]), int(bounds[shard + 1]), data.corpus)
    return datasets.shard(data, shard, shards)


def load_data(ref: DataRef) -> datasets.Dataset:
    """The dataset a task trains or evaluates on."""
    return ref.load() if isinstance(ref, CorpusSlice) else ref


# -- starting weights -------------------------------------------------------------------


def resolve_weights(
    task: TaskPayload,
    cached: Callable[[str], np.ndarray | None],
    fetch: Callable[[str], bytes] | None = None,
    read_checkpoint: Callable[[bytes], np.ndarray] | None = None,
    initialize: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """The task's starting weights, rebuilt bit for bit and checked against their digest.

    `cached(digest)` returns weights the worker holds; `fetch(blob_hash)` reaches update
    blobs and the keyframe (parsed by `read_checkpoint`); `initialize(seed)` draws the
    initial weights. MissingWeights if no way works.
    """
    if task.weights is not None:
        return _checked(task.weights, task.target, "inline weights")
    start, weights = _latest_cached(task, cached)
    if weights is None and task.init_seed is not None and initialize is not None:
        drawn = initialize(task.init_seed)
        if digest(drawn) == task.target.digest:
            return drawn
    if weights is None:
        return _checked(_keyframe(task, fetch, read_checkpoint), task.target, "keyframe")
    for link in task.chain[start:]:
        at = None if task.streaming is None else task.streaming.synced(link.base.round).slice
        weights = apply_update(weights, _message(link, fetch), at)
    return _checked(weights, task.target, "weights rebuilt from the chain")


def _message(link: Link, fetch: Callable[[str], bytes] | None) -> compression.Message:
    if link.message is not None:
        return link.message
    if fetch is None or link.blob is None:
        raise MissingWeights(f"the update after round {link.base.round} is a blob reference "
                             "and this worker cannot fetch blobs")  # fmt: skip
    return compression.decode_message(fetch(link.blob))


def _keyframe(
    task: TaskPayload,
    fetch: Callable[[str], bytes] | None,
    read_checkpoint: Callable[[bytes], np.ndarray] | None,
) -> np.ndarray:
    if not (task.keyframe_blob and fetch and read_checkpoint):
        raise MissingWeights(
            f"this node holds no weights of round {task.target.round} or of the chain "
            "before it, and has no keyframe to fetch: the task needs inline weights"
        )
    return read_checkpoint(fetch(task.keyframe_blob))


def _latest_cached(
    task: TaskPayload, cached: Callable[[str], np.ndarray | None]
) -> tuple[int, np.ndarray | None]:
    target = cached(task.target.digest)
    if target is not None:
        return len(task.chain), target
    for i in range(len(task.chain) - 1, -1, -1):
        weights = cached(task.chain[i].base.digest)
        if weights is not None:
            return i, weights
    return 0, None


def _checked(weights: np.ndarray, ref: WeightsRef, what: str) -> np.ndarray:
    if digest(weights) != ref.digest:
        raise ContainerError(f"{what} do not match the digest of round {ref.round}'s weights")
    return weights


# -- result -----------------------------------------------------------------------------


def encode_result(result: TaskResult) -> bytes:
    """The output blob of a task."""
    arrays: dict[str, np.ndarray] = {}
    update_meta = None
    if result.update is not None:
        update_meta, parts = compression.to_arrays(result.update, "update.")
        arrays.update(parts)
    if result.sketch is not None:
        arrays["sketch"] = np.asarray(result.sketch, dtype=np.float32)
    published_meta = None
    if result.published is not None:
        published_meta, parts = compression.to_arrays(result.published, "published.")
        arrays.update(parts)
    outer_meta = None
    if result.outer is not None:
        outer_meta = {"weights_digest": result.outer.weights_digest}
        arrays["outer.momentum"] = np.asarray(result.outer.momentum, dtype=np.float32)
        if result.outer.residual is not None:
            arrays["outer.residual"] = np.asarray(result.outer.residual, dtype=np.float32)
    header = {
        "format": RESULT_FORMAT,
        "version": VERSION,
        "mode": result.mode,
        "round": result.round,
        "shard": result.shard,
        "seed": result.seed,
        "weights_digest": result.weights_digest,
        "loss_first": result.loss_first,
        "loss_mean": result.loss_mean,
        "loss_last": result.loss_last,
        "update": update_meta,
        "fetched_bytes": result.fetched_bytes,
        "averaging": result.averaging,
        "averaged_digest": result.averaged_digest,
        "next_digest": result.next_digest,
        "update_norm": result.update_norm,
        "members": list(result.members),
        "reason": result.reason,
        "reachability": result.reachability,
        "wire_bytes": result.wire_bytes,
        "blamed": list(result.blamed),
        "published": published_meta,
        "outer": outer_meta,
    }
    return pack(arrays, header)


def _p2p_fields(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The peer-to-peer fields of a result header (absent: a coordinator-mode result)."""
    averaging = header.get("averaging", "")
    if averaging not in ("", "p2p", "fallback"):
        raise ContainerError(f"averaging must be '', 'p2p' or 'fallback', got {averaging!r}")
    reachability = header.get("reachability", "")
    if reachability not in ("", "public", "client"):
        raise ContainerError(f"reachability must be '', 'public' or 'client', got {reachability!r}")
    published_meta, outer_meta = header.get("published"), header.get("outer")
    outer = None
    if outer_meta is not None:
        momentum, residual = arrays.get("outer.momentum"), arrays.get("outer.residual")
        if momentum is None or momentum.dtype != np.float32 or momentum.ndim != 1:
            raise ContainerError("outer.momentum must be a 1-D float32 array")
        if residual is not None and residual.shape != momentum.shape:
            raise ContainerError("outer.residual must match outer.momentum")
        outer = OuterState(str(outer_meta["weights_digest"]), momentum, residual)
    return {
        "averaging": averaging,
        "averaged_digest": str(header.get("averaged_digest", "")),
        "next_digest": str(header.get("next_digest", "")),
        "update_norm": float(header.get("update_norm", 0.0)),
        "members": tuple(int(m) for m in header.get("members", [])),
        "reason": str(header.get("reason", ""))[:2000],
        "reachability": reachability,
        "wire_bytes": max(0, int(header.get("wire_bytes", 0))),
        "blamed": tuple(int(b) for b in header.get("blamed", [])),
        "published": None
        if published_meta is None
        else compression.from_arrays(published_meta, arrays, "published."),
        "outer": outer,
    }


def decode_result(blob: bytes) -> TaskResult:
    """The result of an output blob; ContainerError says what is wrong with it."""
    arrays, header = unpack(blob)
    _check_format(header, RESULT_FORMAT)
    try:
        meta = header["update"]
        update = None if meta is None else compression.from_arrays(meta, arrays, "update.")
        sketch = arrays.get("sketch")
        if sketch is not None and (sketch.dtype != np.float32 or sketch.ndim != 1):
            raise ContainerError("sketch must be a 1-D float32 array")
        return TaskResult(
            mode=_mode(header["mode"]),
            round=int(header["round"]),
            shard=int(header["shard"]),
            seed=int(header["seed"]),
            weights_digest=str(header["weights_digest"]),
            loss_first=float(header["loss_first"]),
            loss_mean=float(header["loss_mean"]),
            loss_last=float(header["loss_last"]),
            update=update,
            sketch=sketch,
            fetched_bytes=max(0, int(header.get("fetched_bytes", 0))),
            **_p2p_fields(header, arrays),
        )
    except ContainerError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ContainerError(f"malformed result header: {exc!r}") from None
