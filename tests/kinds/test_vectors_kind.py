"""The cheap `vectors` kind the adversarial simulation runs on."""

from __future__ import annotations

import numpy as np
import pytest

from idlegrid.kinds.base import InputError, RunContext, Verdict
from idlegrid.kinds.vectors import VectorsKind, VectorsParams, compute, parse, to_npy

KIND = VectorsKind()
PARAMS = VectorsParams(items=25, shard_size=10)


def test_split_covers_every_item_once() -> None:
    shards = KIND.split({}, PARAMS)
    assert [s.items for s in shards] == [10, 10, 5]
    assert [s.index for s in shards] == [0, 1, 2]


def test_run_check_and_assemble_in_order() -> None:
    outputs = [KIND.run(s.payload, PARAMS, RunContext()) for s in KIND.split({}, PARAMS)]
    for shard, output in zip(KIND.split({}, PARAMS), outputs, strict=True):
        KIND.check_output(shard.payload, output, PARAMS)
    whole = parse(KIND.assemble(outputs, PARAMS))
    assert whole.shape == (25, 32)
    np.testing.assert_array_equal(whole, compute(0, 25, 0))
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, rtol=1e-6)


def test_check_output_rejects_wrong_shapes_and_non_npy() -> None:
    payload = KIND.split({}, PARAMS)[0].payload
    with pytest.raises(InputError):
        KIND.check_output(payload, to_npy(compute(0, 9, 0)), PARAMS)
    with pytest.raises(InputError):
        KIND.check_output(payload, b"PK\x03\x04 a zip file", PARAMS)


@pytest.mark.parametrize(
    ("tamper", "verdict"),
    [
        (lambda v: v, Verdict.AGREE),
        (lambda v: v * (1 + 1e-7), Verdict.AGREE),  # last-bit differences between machines
        (
            lambda v: v + np.random.default_rng(1).normal(0, 1e-3, v.shape).astype(np.float32),
            Verdict.DISAGREE,
        ),
        (lambda v: np.zeros_like(v), Verdict.DISAGREE),
        (lambda v: compute(500, 10, 0), Verdict.DISAGREE),  # another shard's answer
        (lambda v: v[:5], Verdict.DISAGREE),
    ],
)
def test_compare(tamper, verdict: Verdict) -> None:  # type: ignore[no-untyped-def]
    honest = compute(0, 10, 0)
    assert (
        KIND.compare(to_npy(honest), to_npy(tamper(honest).astype(np.float32)), PARAMS) is verdict
    )
