"""The `noop` kind: shards that do nothing, for dispatch benchmarks and tests.

Every shard has the same payload and every run the same output, so their blobs are one
input and one output, content-addressed: a worker downloads the input once and uploads
the output once, and what is left to measure is the grid's own dispatch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from pydantic import Field

from idlegrid.kinds.base import InputError, KindParams, RunContext, ShardSpec, TaskKind, Verdict

PAYLOAD = b'{"noop": true}'
OUTPUT = b'{"done": true}'


class NoopParams(KindParams):
    tasks: int = Field(default=4, ge=1, le=1_000_000, description="number of shards")


class NoopKind(TaskKind):
    name = "noop"
    params_model = NoopParams
    input_names = ()
    result_media_type = "application/json"

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, NoopParams)
        return [
            ShardSpec(index=i, payload=PAYLOAD, items=1, cost_flops=1.0)
            for i in range(params.tasks)
        ]

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        ctx.report_progress(1.0)
        return OUTPUT

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        if output != OUTPUT:
            raise InputError(f"noop output must be {OUTPUT.decode()}")

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        return Verdict.AGREE if a == b else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        return json.dumps({"tasks": len(outputs)}).encode()
