"""A node that lies on `llm-generate`: the real `idlegrid worker`, whose outputs lie.

    python tests/llm_adversaries.py worker --server URL --state-dir DIR ...

runs the `idlegrid worker` command with its arguments (the node token in
IDLEGRID_NODE_TOKEN), its daemon a `Worker` that computes every task honestly and then
reports each generation with every log-probability `LOGPROB_SHIFT` lower; its checks of
other nodes' outputs stay honest. Everything else (hardware probe, WebSocket, blobs,
task processes, signals) is the shipped worker's. `start_liar` starts one on a
`LocalGrid`, in a process of its own, as `LocalGrid.start_worker` starts an honest one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.llm_generate.shard import Output, read_output, write_output

# Lower, not higher: a log-probability above 0 is refused as malformed on arrival, while
# this lie is well formed and only a check against the model's own logits catches it.
LOGPROB_SHIFT = 2.0


def shifted_logprobs(output: bytes, shift: float = LOGPROB_SHIFT) -> bytes:
    """A generation's output with each token's log-probability `shift` lower."""
    claimed = read_output(output)
    lie = Output(
        completions=[
            dataclasses.replace(c, logprobs=[lp - shift for lp in c.logprobs])
            for c in claimed.completions
        ],
        backend=claimed.backend,
        build=claimed.build,
    )
    return write_output(lie)


def make_liar_class() -> type:
    """A `Worker` whose generations lie (`shifted_logprobs`) and whose checks do not."""
    from idlegrid.worker.daemon import RunningTask, Worker

    class LogprobLiar(Worker):  # type: ignore[misc]
        async def _compute(self, task: RunningTask, data: bytes) -> bytes:
            output: bytes = await super()._compute(task, data)
            if task.assign.check is not None:
                return output  # a check of another node's output: honest
            return shifted_logprobs(output)

    return LogprobLiar


def start_liar(
    grid: LocalGrid,
    name: str,
    *,
    kinds: str,
    threads: int = 1,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    """Start a lying worker `name` on `grid`, for a volunteer account of its own
    (`volunteer-<name>`), without a benchmark. The grid stops it with its own workers."""
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        "--server",
        grid.url,
        "--state-dir",
        str(grid.root / name),
        "--name",
        name,
        "--dedicated",
        "--control-port",
        "0",
        "--kinds",
        kinds,
        "--threads",
        str(threads),
        "--no-benchmark",
        *extra,
    ]
    token = grid.volunteer_token(f"volunteer-{name}")
    with open(grid.root / f"{name}.log", "a") as log:  # the child keeps its own handle
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**grid.env, "IDLEGRID_NODE_TOKEN": token},
            start_new_session=True,
        )
    grid.workers.append(proc)  # stopped (SIGTERM, then SIGKILL) with the grid's workers
    return proc


def _main(argv: list[str]) -> Any:
    from idlegrid.cli.main import main
    from idlegrid.worker import daemon

    # The command builds its daemon from this module attribute when it runs.
    daemon.Worker = make_liar_class()
    sys.argv = ["idlegrid", *argv]
    return main()


if __name__ == "__main__":
    _main(sys.argv[1:])
