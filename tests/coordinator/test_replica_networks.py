"""How strictly replicas must come from different networks: the operator's rule
(`idlegrid serve --replica-networks`). Under the default, three workers on one machine can
never meet replication 3, and the job waits and says so with the fix (no stalemate rule
fails it); restarted with `shared`, the same job finishes on the same workers."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from click.testing import CliRunner

from idlegrid.cli.serve import replica_rule
from idlegrid.coordinator.monitor import STALEMATE_INTERVAL_S
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.settings import REPLICA_NETWORKS, CoordinatorSettings


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        (
            "distinct",
            "distinct networks (IPv4 /24, IPv6 /48); one network: --replica-networks shared",
        ),
        ("address", "distinct addresses (--replica-networks address)"),
        ("shared", "any networks (--replica-networks shared)"),
    ],
)
def test_each_rule_sets_the_network_settings(rule: str, words: str) -> None:
    settings = CoordinatorSettings(**REPLICA_NETWORKS[rule])
    assert replica_rule(settings) == f"distinct nodes, distinct accounts, {words}"


def test_serve_refuses_an_unknown_rule() -> None:
    from idlegrid.cli.main import main

    result = CliRunner().invoke(main, ["serve", "--replica-networks", "loose"])
    assert result.exit_code == 2 and "'distinct', 'address', 'shared'" in result.output


@pytest.mark.slow
def test_a_job_on_one_network_finishes_once_the_operator_allows_it(tmp_path: Path) -> None:
    strict = {"IDLEGRID_DISTINCT_NETWORKS": "true", "IDLEGRID_MONITOR_INTERVAL_S": "0.5"}
    with LocalGrid(tmp_path, extra_env=strict, heartbeat_s=1.0) as grid:
        for name in ("a", "b", "c"):  # three volunteers, each an account of its own
            grid.start_worker(name, kinds="sleep", benchmark=False)
        grid.wait_for_nodes(3)
        with grid.client() as client:
            job = client.submit("sleep", params={"tasks": 2, "seconds": 0.05}, replication=3)
            deadline = time.monotonic() + 60
            while not any("another network" in w for w in job.info()["waiting_for"]):
                assert time.monotonic() < deadline, job.info()
                time.sleep(0.2)
            # A shard has a result and nobody else may run it: a stalemate pass must
            # find it held back by the network rule alone, and leave it waiting. Such a
            # pass changes nothing one can see (no row, counter or log line; `waiting_for`
            # is worked out on each request, pass or not), so there is no signal to wait
            # on: the coordinator's stalemate loop runs every STALEMATE_INTERVAL_S, and
            # after that and 1 s more for the pass itself, one has run since the shard
            # stalled and must not have failed the job.
            time.sleep(STALEMATE_INTERVAL_S + 1)
            info = job.info()
            assert info["state"] in ("queued", "running"), info
            (reason,) = [w for w in info["waiting_for"] if "replication 3" in w]
            assert "1 network(s)" in reason and "can hold 1 replica(s)" in reason
            assert "--replica-networks shared" in reason

            grid.kill_coordinator()
            grid.env["IDLEGRID_REPLICA_NETWORKS"] = "shared"
            grid.start_coordinator(port=urlparse(grid.url).port or 0)
            assert job.wait(timeout=120)["state"] == "completed"
            assert job.info()["effective_replication"] >= 3
