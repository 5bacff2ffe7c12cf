"""The DiLoCo tables of docs/benchmarks.md from the sweeps' results, and the loss plot.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco_report.py \\
        benchmarks/results/diloco_sweep_h200.jsonl benchmarks/results/diloco_horizon_h200.jsonl \\
        [--plot docs/img/diloco_loss.png]
    PYTHONPATH=src .venv/bin/python benchmarks/diloco_report.py --streaming \\
        benchmarks/results/diloco_streaming_cpu.jsonl

Reads the `results.jsonl` files `benchmarks/diloco_sweep.py` wrote (runs named as its
plans name them) and prints: the headline comparison over seeds (3,000 steps), the
tuning sweeps, each lever on its own, the longer horizon, and the asynchronous mode on
the virtual clock. Losses are test losses; "selected" is the checkpoint of lowest
validation loss, with the bytes moved up to it. The last line is the headline's
`bytes_ratio: X loss_gap: Y%` (fp32 synchronous baseline against DiLoCo H=100, selected
checkpoints). With `--streaming`, only the streaming plan's table: plain DiLoCo against
its fragments, with the bytes each round moves.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from diloco_simulate import Report, compare

PLOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "diloco_loss.png"


def load(paths: Sequence[Path]) -> tuple[dict[str, Report], dict[str, dict]]:
    """Runs by name: simulation reports, and timeline rows."""
    reports: dict[str, Report] = {}
    timelines: dict[str, dict] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["rc"] != 0:
                continue
            if row["flags"][0] == "timeline":
                timelines[row["name"]] = row["report"][0]
            else:
                reports[row["name"]] = Report.from_json(row["report"][0]["report"])
    return reports, timelines


def seeds(reports: dict[str, Report], prefix: str) -> list[Report]:
    return [reports[f"{prefix} seed={seed}"] for seed in (0, 1, 2)
            if f"{prefix} seed={seed}" in reports]  # fmt: skip


def _spread(values: Sequence[float]) -> str:
    return (
        f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}"
        if len(values) > 1
        else (f"{values[0]:.4f}")
    )


def headline(reports: dict[str, Report]) -> tuple[float, float]:
    sync, int4 = seeds(reports, "sync-fp32 lr=1e-2"), seeds(reports, "sync-int4 lr=1e-2")
    diloco = seeds(reports, "diloco H=100 lr=3e-3")
    print(f"Headline, 3,000 steps, seeds 0-{len(sync) - 1}: test loss mean ± sd over seeds")
    print("| run | final | selected | bytes/worker to selected | bytes_ratio, selected "
          "| loss_gap, selected (per seed) | bytes_ratio, final | loss_gap, final |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in (("sync fp32 gradients", sync), ("sync int4 gradients", int4),
                       ("DiLoCo H=100, int4", diloco)):  # fmt: skip
        final = _spread([r.final.test for r in runs])
        chosen = _spread([r.selected.test for r in runs])
        moved = np.mean([r.selected.bytes for r in runs])
        if runs is sync:
            print(f"| {name} | {final} | {chosen} | {moved:,.0f} | 1 | - | 1 | - |")
            continue
        selected, at_end = compare(sync, runs), compare(sync, runs, selected=False)
        gaps = ", ".join(f"{g:.2f}" for g in selected.gaps)
        print(f"| {name} | {final} | {chosen} | {moved:,.0f} | {selected.bytes_ratio:.1f} "
              f"| {selected.loss_gap:.2f}% ({gaps}) | {at_end.bytes_ratio:.1f} "
              f"| {at_end.loss_gap:.2f}% |")  # fmt: skip
    against_int4 = compare(int4, diloco)
    print(f"DiLoCo against the int4 baseline: bytes_ratio {against_int4.bytes_ratio:.1f}, "
          f"loss_gap {against_int4.loss_gap:.2f}%")  # fmt: skip
    result = compare(sync, diloco)
    return result.bytes_ratio, result.loss_gap


def table(reports: dict[str, Report], names: Sequence[str], baseline: Report) -> None:
    """One row a run (seed 0): its validation and test losses, gap and ratio to `baseline`."""
    print("| run | validation, selected | test, selected | test, final "
          "| loss_gap, selected | bytes_ratio, selected |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        if name not in reports:
            print(f"| {name} | not run | | | | |")
            continue
        run = reports[name]
        one = compare([baseline], [run]) if not name.startswith("sync") else None
        gap = f"{one.loss_gap:.2f}%" if one else "-"
        ratio = f"{one.bytes_ratio:.1f}" if one else "-"
        print(f"| {name} | {run.selected.validation:.4f} | {run.selected.test:.4f} "
              f"| {run.final.test:.4f} | {gap} | {ratio} |")  # fmt: skip


def horizon(reports: dict[str, Report]) -> None:
    sync = seeds(reports, "sync-fp32 steps=6000")
    print(f"6,000 steps: sync fp32 test loss {_spread([r.selected.test for r in sync])} "
          "(selected)")  # fmt: skip
    print("| DiLoCo run | seeds | test, selected | loss_gap, selected | bytes_ratio, selected "
          "| loss_gap, final | bytes_ratio, final |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = {
        "H=100": [reports.get("diloco H=100 steps=6000 seed=0")],
        "H=100, outer momentum 0.8": [reports.get("diloco H=100 outer-momentum=0.8 steps=6000 "
                                                  "seed=0")],
        "H=200": [reports.get("diloco H=200 seed=0"), reports.get("diloco H=200 steps=6000 seed=1"),
                  reports.get("diloco H=200 steps=6000 seed=2")],
        "H=200, outer momentum 0.8": [reports.get("diloco H=200 outer-momentum=0.8 steps=6000 "
                                                  "seed=0")],
    }  # fmt: skip
    for name, found in rows.items():
        runs = [r for r in found if r is not None]
        if not runs:
            continue
        base = sync[: len(runs)]
        chosen, final = compare(base, runs), compare(base, runs, selected=False)
        print(f"| {name} | {len(runs)} | {_spread([r.selected.test for r in runs])} "
              f"| {chosen.loss_gap:.2f}% | {chosen.bytes_ratio:.1f} | {final.loss_gap:.2f}% "
              f"| {final.bytes_ratio:.1f} |")  # fmt: skip


def asynchronous(timelines: dict[str, dict]) -> None:
    print("| case | mode | time to validation loss target | time of 20 rounds | test loss, "
          "final | stale applied | stale dropped |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for case in ("slow", "churn"):
        pair = {mode: timelines.get(f"timeline {case} {mode}")
                for mode in ("synchronous", "asynchronous")}  # fmt: skip
        if None in pair.values():
            continue
        target = max(row["curve"][-1][2] for row in pair.values())  # type: ignore[index]
        for mode, row in pair.items():
            assert row is not None
            reached = next((t for t, _, v, _ in row["curve"] if v <= target), None)
            shown = "not reached" if reached is None else f"{reached:.1f}"
            print(f"| {case} | {mode} | {shown} (target {target:.4f}) | {row['final_time']:.1f} "
                  f"| {row['final_test']:.4f} | {row['applied_stale']} "
                  f"| {row['dropped_stale']} |")  # fmt: skip


STREAMING = (
    "diloco H=100 lr=3e-3 seed=0",
    "diloco fragments=2 H=50 seed=0",
    "diloco fragments=2 H=50 mix=0.5 seed=0",
    "diloco mix=0.5 seed=0",
    "diloco fragments=2 H=100 seed=0",
    "diloco H=200 steps=3000 seed=0",
)


def streaming(reports: dict[str, Report]) -> None:
    """Streaming DiLoCo's fragments against plain DiLoCo, seed 0, 3,000 steps."""
    base = reports.get("sync-fp32 lr=1e-2 seed=0")
    if base is None:
        print("streaming: no sync-fp32 lr=1e-2 seed=0 run to compare with")
        return
    print("Streaming DiLoCo, 3,000 steps, seed 0, against sync fp32 (test loss; a round's "
          "bytes: one worker's upload and download in the last round):")  # fmt: skip
    print("| run | rounds | test, selected | test, final | loss_gap, selected "
          "| bytes_ratio, selected | bytes a round per worker |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in STREAMING:
        run = reports.get(name)
        if run is None:
            print(f"| {name} | not run | | | | | |")
            continue
        one = compare([base], [run])
        per_round = run.curve[-1].bytes - run.curve[-2].bytes
        print(f"| {name} | {len(run.curve) - 1} | {run.selected.test:.4f} "
              f"| {run.final.test:.4f} | {one.loss_gap:.2f}% | {one.bytes_ratio:.1f} "
              f"| {per_round:,} |")  # fmt: skip


def plot(reports: dict[str, Report], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (short, long) = plt.subplots(1, 2, figsize=(12, 4.5))
    pairs = [(short, "sync-fp32 lr=1e-2", "diloco H=100 lr=3e-3", "3,000 steps, H=100"),
             (long, "sync-fp32 steps=6000", "diloco H=200", "6,000 steps, H=200")]  # fmt: skip
    for axes, sync_name, diloco_name, title in pairs:
        for seed in (0, 1, 2):
            sync = reports.get(f"{sync_name} seed={seed}")
            diloco = reports.get(f"{diloco_name} seed={seed}")
            if diloco is None and seed > 0:
                diloco = reports.get(f"diloco H=200 steps=6000 seed={seed}")
            for run, style, color, label in ((sync, "-", "tab:blue", "sync data-parallel"),
                                              (diloco, "--", "tab:orange", "DiLoCo")):  # fmt: skip
                if run is None:
                    continue
                points = [p for p in run.curve if p.step > 0]
                axes.plot([p.step for p in points], [p.test for p in points], style,
                          color=color, alpha=0.8,
                          label=f"{label}, seeds 0-2" if seed == 0 else None)  # fmt: skip
        axes.set_title(f"cpython-stdlib, K=4, {title}")
        axes.set_xlabel("inner steps per worker")
        axes.set_ylabel("test loss (nats/char)")
        axes.set_ylim(1.3, 2.2)
        axes.grid(alpha=0.3)
        axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--streaming", action="store_true",
                        help="only the streaming plan's table (`diloco_sweep.py --plan "
                             "streaming`)")  # fmt: skip
    args = parser.parse_args(argv)
    reports, timelines = load(args.results)
    if args.streaming:
        streaming(reports)
        return 0
    ratio, gap = headline(reports)
    base = reports["sync-fp32 lr=1e-2 seed=0"]
    print("\nTuning at 3,000 steps, seed 0 (chosen by validation loss):")
    sweep = ["sync-fp32 lr=5e-3 seed=0", "sync-fp32 lr=1e-2 seed=0", "sync-fp32 lr=2e-2 seed=0",
             "sync-fp32 lr=3e-2 seed=0", "sync-fp32 lr=1e-2 decay=2000 seed=0",
             "diloco H=100 lr=1.5e-3 seed=0", "diloco H=100 lr=3e-3 seed=0",
             "diloco H=100 lr=6e-3 seed=0"]  # fmt: skip
    table(reports, sweep, base)
    print("\nLevers, each on its own from DiLoCo's defaults, 3,000 steps, seed 0 "
          "(workers=8 against its own 8-worker baseline):")  # fmt: skip
    levers = ["diloco H=50 steps=3000 seed=0", "diloco outer-lr=0.7 seed=0",
              "diloco outer-lr=1.4 seed=0", "diloco outer-momentum=0.6 seed=0",
              "diloco outer-momentum=0.8 seed=0", "diloco outer-lr=0.8 outer-momentum=0.8 seed=0",
              "diloco task-warmup=20 seed=0", "diloco int8 seed=0",
              "diloco sign-upload seed=0"]  # fmt: skip
    table(reports, levers, base)
    table(reports, ["diloco workers=8 seed=0"], reports["sync-fp32 workers=8 lr=1e-2 seed=0"])
    for prefix in ("diloco outer-momentum=0.8", "diloco outer-momentum=0.8 lr=6e-3"):
        runs = seeds(reports, prefix)
        result = compare(seeds(reports, "sync-fp32 lr=1e-2")[: len(runs)], runs)
        print(f"{prefix}, {len(runs)} seeds: loss_gap {result.loss_gap:.2f}% "
              f"({result.spread}), bytes_ratio {result.bytes_ratio:.1f}")  # fmt: skip
    print()
    horizon(reports)
    print("\nAsynchronous against synchronous rounds (virtual clock, 1.0 = one task of H=50):")
    asynchronous(timelines)
    if args.plot:
        plot(reports, args.plot)
        print(f"loss curves: {args.plot}")
    print(f"bytes_ratio: {ratio:.1f} loss_gap: {gap:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
