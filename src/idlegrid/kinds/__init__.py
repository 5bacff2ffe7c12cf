"""Built-in task kinds. Volunteers only ever run these: no researcher code."""

from __future__ import annotations

from idlegrid import p2p
from idlegrid.kinds.base import (
    Cancelled,
    InputError,
    KindParams,
    Requirements,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
    WrongOutput,
)
from idlegrid.kinds.diloco.kind import DilocoKind
from idlegrid.kinds.embed_text.kind import EmbedTextKind
from idlegrid.kinds.llm_generate.kind import LlmGenerateKind
from idlegrid.kinds.noop import NoopKind
from idlegrid.kinds.onnx.kind import OnnxInferKind
from idlegrid.kinds.sleep import SleepKind
from idlegrid.kinds.vectors import VectorsKind

KINDS: dict[str, TaskKind] = {
    kind.name: kind
    for kind in (
        DilocoKind(),
        EmbedTextKind(),
        LlmGenerateKind(),
        NoopKind(),
        OnnxInferKind(),
        SleepKind(),
        VectorsKind(),
    )
}


# What a node may list among its kinds beyond them: abilities some jobs require
# (`Requirements.offers`): averaging peer to peer.
CAPABILITIES = frozenset({p2p.CAPABILITY})


class UnknownKind(LookupError):
    pass


def get_kind(name: str) -> TaskKind:
    """The built-in kind called `name`."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(
            f"unknown kind {name!r}; known kinds: {', '.join(sorted(KINDS))}"
        ) from None


__all__ = [
    "CAPABILITIES",
    "KINDS",
    "Cancelled",
    "InputError",
    "WrongOutput",
    "KindParams",
    "Requirements",
    "RunContext",
    "ShardSpec",
    "TaskKind",
    "UnknownKind",
    "Verdict",
    "get_kind",
]
