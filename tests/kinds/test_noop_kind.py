"""The noop kind: one shared input and output blob, checked and compared exactly."""

from __future__ import annotations

import json

import pytest

from idlegrid.kinds import InputError, RunContext, Verdict, get_kind
from idlegrid.kinds.noop import OUTPUT


def _ctx() -> RunContext:
    return RunContext(
        device="cpu", threads=1, report_progress=lambda _: None, is_cancelled=lambda: False
    )


def test_shards_share_one_payload_and_runs_one_output() -> None:
    kind = get_kind("noop")
    params = kind.parse_params({"tasks": 5})
    shards = kind.split({}, params)
    assert [s.index for s in shards] == [0, 1, 2, 3, 4]
    assert len({s.payload for s in shards}) == 1
    outputs = {kind.run(s.payload, params, _ctx()) for s in shards}
    assert outputs == {OUTPUT}
    assert json.loads(kind.assemble([OUTPUT] * 5, params)) == {"tasks": 5}


def test_other_output_is_refused_and_disagrees() -> None:
    kind = get_kind("noop")
    params = kind.parse_params({"tasks": 1})
    kind.check_output(b"", OUTPUT, params)
    with pytest.raises(InputError):
        kind.check_output(b"", b'{"done": false}', params)
    assert kind.compare(OUTPUT, OUTPUT, params) is Verdict.AGREE
    assert kind.compare(OUTPUT, b"x", params) is Verdict.DISAGREE
