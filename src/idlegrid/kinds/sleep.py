"""The `sleep` kind: each item sleeps a while and echoes a checksum. For tests and benchmarks."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence

from pydantic import Field

from idlegrid.kinds.base import (
    Cancelled,
    InputError,
    KindParams,
    Requirements,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
)


class SleepParams(KindParams):
    tasks: int = Field(default=4, ge=1, le=1_000_000, description="number of shards")
    seconds: float = Field(default=0.0, ge=0.0, le=3600.0, description="sleep per shard")
    backend: str = Field(
        default="",
        pattern=r"^(|cpu|cuda|rocm|mps)$",
        description="only nodes with this backend may run it (tests of hardware filters)",
    )
    hashes: int = Field(
        default=0,
        ge=0,
        le=10**9,
        description="SHA-256 rounds per shard after the sleep: busy CPU (tests of pausing)",
    )


class SleepKind(TaskKind):
    """Shards that sleep `seconds` and return a digest of their index: cheap and checkable."""

    name = "sleep"
    params_model = SleepParams
    input_names = ()
    result_media_type = "application/json"

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, SleepParams)
        return [
            ShardSpec(
                index=i,
                payload=json.dumps(
                    {"index": i, "seconds": params.seconds, "hashes": params.hashes}
                ).encode(),
                items=1,
                # Nominal: a 1-GFLOPS node sleeps `seconds`; the lease and the scheduler's
                # time estimates scale with the node's benchmark from this.
                cost_flops=max(params.seconds, 0.001) * 1e9,
            )
            for i in range(params.tasks)
        ]

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, SleepParams)
        if not params.backend:
            return Requirements()
        return Requirements(
            backends=frozenset({params.backend}), accelerator=params.backend != "cpu"
        )

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        spec = json.loads(payload)
        deadline = time.monotonic() + float(spec["seconds"]) * ctx.slowdown
        while (left := deadline - time.monotonic()) > 0:
            if ctx.is_cancelled():
                raise Cancelled()
            time.sleep(min(left, 0.05))
        rounds = int(spec.get("hashes", 0))
        chain = _chain(spec["index"], rounds, ctx) if rounds else None
        ctx.report_progress(1.0)
        return _digest(spec["index"], chain)

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        try:
            json.loads(output)["digest"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError("sleep output must be JSON with a 'digest'") from exc

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        return Verdict.AGREE if a == b else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        return json.dumps([json.loads(o) for o in outputs]).encode()


def _digest(index: int, chain: str | None = None) -> bytes:
    digest = hashlib.sha256(f"sleep:{index}".encode()).hexdigest()
    out: dict[str, object] = {"index": index, "digest": digest}
    if chain is not None:
        out["chain"] = chain
    return json.dumps(out).encode()


def hash_chain(index: int, rounds: int) -> str:
    """SHA-256 applied `rounds` times from the shard's index: what a busy shard returns."""
    value = f"sleep:{index}".encode()
    for _ in range(rounds):
        value = hashlib.sha256(value).digest()
    return value.hex()


def _chain(index: int, rounds: int, ctx: RunContext) -> str:
    value = f"sleep:{index}".encode()
    for done in range(rounds):
        if done % 20_000 == 0:
            if ctx.is_cancelled():
                raise Cancelled()
            ctx.report_progress(done / rounds)
        value = hashlib.sha256(value).digest()
    return value.hex()
