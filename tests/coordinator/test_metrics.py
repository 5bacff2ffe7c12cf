"""The Prometheus `/metrics` page of a coordinator process."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner
from conftest import Api, bearer

from idlegrid.cli.main import main


def _samples(text: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in re.findall(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, flags=re.MULTILINE)
    }


def test_metrics_describe_the_grid_in_the_text_format(api: Api) -> None:
    alice = api.token(account="alice")
    job = api.submit(alice, kind="sleep", params={"tasks": 3, "seconds": 0})
    response = api.client.get("/metrics", headers=api.admin)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name in (
        "idlegrid_connected_nodes",
        "idlegrid_ready_queue_depth",
        "idlegrid_tasks",
        "idlegrid_results_total",
        "idlegrid_lease_expiries_total",
    ):
        assert f"# TYPE {name} " in text
    samples = _samples(text)
    assert samples["idlegrid_connected_nodes"] == 0
    assert samples["idlegrid_ready_queue_depth"] == 3
    assert samples['idlegrid_tasks{state="ready"}'] == 3
    assert samples['idlegrid_tasks{state="completed"}'] == 0
    assert samples['idlegrid_jobs{state="queued"}'] == 1
    assert samples['idlegrid_results_total{status="accepted"}'] == 0
    assert samples['idlegrid_results_verified_total{outcome="invalid"}'] == 0
    assert samples["idlegrid_lease_expiries_total"] == 0
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(alice))
    samples = _samples(api.client.get("/metrics", headers=api.admin).text)
    assert samples['idlegrid_tasks{state="cancelled"}'] == 3
    assert samples['idlegrid_jobs{state="cancelled"}'] == 1


def test_migrate_command_brings_a_database_up_to_date(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["migrate", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert "newest migration" in result.output
    assert (tmp_path / "data" / "idlegrid.db").is_file()
