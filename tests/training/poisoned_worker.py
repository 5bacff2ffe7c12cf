"""A worker daemon that poisons its DiLoCo updates: a test's adversary, not shipped code.

    python tests/training/poisoned_worker.py --server URL --token T --state-dir D --name N \
        [--scale 1000]

It runs the `diloco-train` kind honestly, then multiplies the pseudo-gradient of every
training result (and its sketch, so the lie is self-consistent) by `--scale` before
uploading it, re-compressed the way the job asks: a result the coordinator's output
checks accept (finite, the right method and size), whose only fault is its size.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from idlegrid.kinds import get_kind
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.settings import WorkerSettings
from idlegrid.training.compression import compress, decode
from idlegrid.worker.daemon import RunningTask, Worker


def poison(output: bytes, params: DilocoParams, scale: float) -> bytes:
    """The same result with its update and sketch scaled by `scale` (training results)."""
    result = tasks.decode_result(output)
    if result.mode != "train" or result.update is None or result.sketch is None:
        return output
    update, _ = compress(scale * decode(result.update), params.upload.model_copy(
        update={"error_feedback": False}))  # fmt: skip
    return tasks.encode_result(
        dataclasses.replace(result, update=update, sketch=scale * result.sketch)
    )


class PoisonedWorker(Worker):
    def __init__(self, settings: WorkerSettings, scale: float) -> None:
        super().__init__(settings)
        self.scale = scale

    async def _compute(self, task: RunningTask, data: bytes) -> bytes:
        output = await super()._compute(task, data)
        if task.assign.kind != "diloco-train":
            return output
        params = get_kind(task.assign.kind).parse_params(task.assign.params)
        assert isinstance(params, DilocoParams)
        return poison(output, params, self.scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--name", default="poisoner")
    parser.add_argument("--scale", type=float, default=1000.0)
    args = parser.parse_args()
    settings = WorkerSettings(
        servers=(args.server,), token=args.token, state_dir=args.state_dir, name=args.name,
        kinds=("diloco-train",), benchmark=False, threads=1, dedicated=True,
        control_port=-1,
    )  # fmt: skip
    asyncio.run(PoisonedWorker(settings, args.scale).run())


if __name__ == "__main__":
    main()
