"""The in-process DiLoCo reference run: training works and bytes are counted both ways."""

from __future__ import annotations

import dataclasses
import math

import diloco_simulate as simulate
import numpy as np
import pytest

from idlegrid.kinds.diloco.inner import InnerSettings, for_round
from idlegrid.training import models, verify
from idlegrid.training.compression import Compression
from idlegrid.training.outer import OuterSettings

pytest.importorskip("torch")

TINY = simulate.Setup(
    workers=2,
    rounds=3,
    corpus="pydoc-topics",
    model=models.LMConfig(vocab=103, context=16, width=16, layers=1, heads=2),
    inner=InnerSettings(steps=6, batch_size=4, seq_len=16, lr=3e-3),
    outer=OuterSettings(lr=0.7, momentum=0.9),
    upload=Compression(method="int8"),
    download=Compression(method="int8"),
    eval_batches=2,
    sync_lr=None,
)


# Per result: a count sketch and the container's JSON header, whatever the model's size.
RESULT_OVERHEAD = 4 * verify.SKETCH_SIZE + 1500


def test_diloco_lowers_the_held_out_loss_and_counts_its_bytes() -> None:
    report = simulate.run_diloco(TINY, progress=lambda line: None)
    losses = [point.validation for point in report.curve]
    assert [point.step for point in report.curve] == [0, 6, 12, 18]
    assert losses[-1] < losses[0] - 0.3
    assert report.final.test < report.curve[0].test - 0.3
    # Traffic so far grows every round and ends at the run's total.
    traffic = [point.bytes for point in report.curve]
    assert traffic == sorted(traffic) and traffic[-1] == report.bytes_per_worker
    size = models.parameter_count("transformer-lm", TINY.model)
    # Round 0 downloads fp32 weights; rounds 1 and 2 only an int8 update each.
    assert 4 * size + 2 * size < report.bytes_received < 4 * size + 2 * 1.05 * size + 6000
    assert 3 * size < report.bytes_sent < 3 * (1.05 * size + RESULT_OVERHEAD)


def test_a_seeded_start_saves_round_0_weights_and_changes_nothing_else() -> None:
    short = dataclasses.replace(TINY, rounds=2)
    inline = simulate.run_diloco(short, progress=lambda line: None)
    seeded = simulate.run_diloco(
        dataclasses.replace(short, seeded_start=True), progress=lambda line: None
    )
    size = models.parameter_count("transformer-lm", TINY.model)
    assert 4 * size <= inline.initial_weights == seeded.initial_weights < 4 * size + 200
    # Means over workers, rounded down: equal to within a byte.
    assert abs(seeded.bytes_received - (inline.bytes_received - inline.initial_weights)) <= 1
    assert seeded.bytes_sent == inline.bytes_sent
    losses = [(point.validation, point.test) for point in seeded.curve]
    assert losses == [(point.validation, point.test) for point in inline.curve]
    for report in (inline, seeded):
        assert abs(report.bytes_with_initial_weights(True) - inline.bytes_per_worker) <= 1
        assert abs(report.bytes_with_initial_weights(False) - seeded.bytes_per_worker) <= 1


def test_sync_counts_a_ring_all_reduce_every_step() -> None:
    report = simulate.run_sync(TINY, progress=lambda line: None)
    size = models.parameter_count("transformer-lm", TINY.model)
    assert report.bytes_sent == report.bytes_received == TINY.steps * 2 * 1 * 4 * size // 2
    assert report.final.validation < report.curve[0].validation
    assert [point.bytes for point in report.curve[1:]] == [
        2 * step * simulate.allreduce_bytes(4 * size, 2) for step in (6, 12, 18)
    ]
    assert simulate.allreduce_bytes(4000, 4) == 6000


def test_a_quantized_baseline_counts_its_quantized_gradients() -> None:
    int4 = dataclasses.replace(TINY, sync_gradients=Compression(method="int4", error_feedback=True))
    report = simulate.run_sync(int4, progress=lambda line: None)
    size = models.parameter_count("transformer-lm", TINY.model)
    wire = math.ceil(size / 2) + 4 * math.ceil(size / 256)  # nibbles and one scale a chunk
    assert report.name == "sync-int4"
    assert report.bytes_sent == TINY.steps * simulate.allreduce_bytes(wire, 2)
    assert report.final.validation < report.curve[0].validation


def test_topk_upload_sends_one_percent_as_index_value_pairs() -> None:
    upload = Compression(method="topk", topk_fraction=0.01)
    topk = dataclasses.replace(TINY, rounds=2, upload=upload)
    size = models.parameter_count("transformer-lm", TINY.model)
    sent = simulate.run_diloco(topk, progress=lambda line: None).bytes_sent
    assert sent < 2 * (8 * math.ceil(0.01 * size) + RESULT_OVERHEAD) < 2 * size


def test_the_command_line_prints_the_ratio_last(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workers", "2", "--rounds", "1", "--inner-steps", "2", "--batch-size", "2",
            "--seq-len", "16", "--width", "16", "--layers", "1"]  # fmt: skip
    assert simulate.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("bytes_ratio: ") and " loss_gap: " in last


def test_the_default_setup_is_the_tuned_one() -> None:
    args = simulate.parse_args([])
    assert simulate.setup_from(args, 0) == simulate.Setup(
        model=models.LMConfig(vocab=96, context=64, width=64, layers=2, heads=4)
    )
    pydoc = simulate.setup_from(simulate.parse_args(["--corpus", "pydoc-topics"]), 0)
    assert pydoc.corpus == "pydoc-topics" and pydoc.model.vocab == 103


def test_a_task_of_round_r_starts_at_run_step_r_times_h() -> None:
    assert [for_round(TINY.spec().inner, r).first_step for r in range(3)] == [0, 6, 12]
    assert for_round(TINY.spec().inner, 2).steps == TINY.inner.steps
    assert TINY.round_ends() == [6, 12, 18] and TINY.steps == 18


def test_a_ramp_runs_short_rounds_first_and_keeps_the_run_length() -> None:
    args = simulate.parse_args(["--total-steps", "35", "--inner-steps", "10", "--ramp", "2", "3"])
    setup = simulate.setup_from(args, 0)
    assert (setup.rounds, setup.steps, setup.inner.ramp) == (5, 35, (2, 3))
    assert setup.round_ends() == [2, 5, 15, 25, 35]
    tasks = [for_round(setup.inner, r) for r in range(5)]
    assert [(t.first_step, t.steps) for t in tasks] == [(0, 2), (2, 3), (5, 10), (15, 10), (25, 10)]


def test_a_ramped_run_trains_every_round_with_its_own_h() -> None:
    ramped = dataclasses.replace(
        TINY, rounds=3, inner=TINY.inner.model_copy(update={"ramp": (2, 4)})
    )
    report = simulate.run_diloco(ramped, progress=lambda line: None)
    sync = simulate.run_sync(ramped, progress=lambda line: None)
    steps = [point.step for point in report.curve]
    assert steps == [point.step for point in sync.curve] == [0, 2, 6, 12]


def test_several_h_share_one_run_length() -> None:
    args = simulate.parse_args(
        ["--total-steps", "400", "--inner-steps", "25", "100", "--schedule", "cosine"]
    )
    setups = [simulate.setup_from(args, 0, h) for h in args.inner_steps]
    assert [(s.rounds, s.inner.steps, s.steps) for s in setups] == [(16, 25, 400), (4, 100, 400)]
    assert all(s.inner.decay_steps == 400 for s in setups)
    constant = simulate.parse_args(["--schedule", "constant"])
    assert simulate.setup_from(constant, 0).inner.decay_steps is None


@pytest.mark.parametrize(
    "argv",
    [["--inner-steps", "25", "50"], ["--total-steps", "100", "--inner-steps", "30"]],
)
def test_run_lengths_that_do_not_fit_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        simulate.parse_args(argv)


def report(name: str, points: list[tuple[int, float, float, int]], total: int) -> simulate.Report:
    curve = [simulate.Checkpoint(*point) for point in points]
    return simulate.Report(name, curve, total // 2, total - total // 2)


def test_the_ratio_line_compares_validation_selected_checkpoints_on_test() -> None:
    # Each baseline is selected at step 10 (lowest validation), where it has moved less.
    syncs = [
        report("sync", [(0, 5.0, 5.0, 0), (10, 2.0, 2.1, 1000), (20, 2.2, 2.0, 2000)], 2000),
        report("sync", [(0, 5.0, 5.0, 0), (10, 1.0, 0.9, 3000), (20, 1.1, 0.8, 6000)], 6000),
    ]
    dilocos = [
        report("diloco", [(0, 5.0, 5.0, 0), (10, 1.9, 1.8, 10), (20, 1.8, 2.0, 20)], 20),
        report("diloco", [(0, 5.0, 5.0, 0), (10, 1.6, 1.5, 30), (20, 1.5, 1.5, 40)], 40),
    ]
    ratio, gap = simulate.ratio_line(syncs, dilocos)
    assert ratio == pytest.approx(2000 / 30)  # bytes up to each selected checkpoint
    assert gap == pytest.approx(100 * (1.75 / 1.5 - 1))  # their test losses
    final = simulate.compare(syncs, dilocos, selected=False)
    assert final.bytes_ratio == pytest.approx(4000 / 30)
    assert final.loss_gap == pytest.approx(100 * (1.75 / 1.4 - 1))
    assert final.gaps == pytest.approx((0.0, 87.5))


def test_reports_survive_json() -> None:
    original = report("sync", [(0, 5.0, 4.0, 0), (10, 2.0, 2.1, 1000)], 1000)
    assert simulate.Report.from_json(original.to_json()) == original


def test_a_node_keeps_moments_per_shard_for_later_rounds_only() -> None:
    from idlegrid.kinds.diloco.worker_state import OptimizerState, WorkerState

    node = WorkerState(optimizer_capacity=2)
    moments = OptimizerState(3, np.zeros(4, np.float32), np.ones(4, np.float32))
    node.set_optimizer_state("run", 1, 5, moments)
    assert node.optimizer_state("run", 1, 6) is moments
    assert node.optimizer_state("run", 1, 5) is None  # made by this round: not a past one
    assert node.optimizer_state("run", 0, 6) is None and node.optimizer_state("other", 1, 6) is None
    node.set_optimizer_state("run", 2, 5, moments)
    node.set_optimizer_state("other", 0, 5, moments)  # over capacity: the oldest goes
    assert node.optimizer_shards("run") == [2] and node.optimizer_shards("other") == [0]
