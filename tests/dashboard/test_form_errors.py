"""Forms posted past the browser's checks come back as the same form: what was typed,
and each field's error beside it, never a bare error page."""

from __future__ import annotations

import re

from conftest import Api
from test_dashboard import Browser, _researcher, _upload

from idlegrid.dashboard.forms import summary


def _field_error(page: str, name: str) -> str:
    found = re.search(rf'<small class="field-error" id="{name}-error" role="alert">([^<]+)<', page)
    assert found, f"no error beside {name}"
    return found.group(1)


def test_a_job_form_comes_back_with_its_values_and_errors(api: Api) -> None:
    researcher = _researcher(api, "fern")
    assert _upload(researcher, b'"a text"\n"another"').status_code == 200
    upload_id = re.search(r"kind=embed-text&amp;file=(\d+)", researcher.get("/research/files").text)
    assert upload_id is not None
    page = researcher.post(
        "/research/jobs/new/embed-text",
        {"texts": upload_id.group(1), "shard_size": 0, "replication": "three", "priority": 7},
        form="/research/jobs/new",
    )
    assert (
        page.status_code == 422
        and '<form method="post" action="/research/jobs/new/embed-text"' in page.text
    )
    assert "greater than or equal to 1" in _field_error(page.text, "shard_size")
    assert "valid integer" in _field_error(page.text, "replication")
    assert "shard size, replication" in page.text  # the line above the form
    assert 'value="three"' in page.text and 'value="7"' in page.text  # as typed
    assert f'<option value="{upload_id.group(1)}" selected' in page.text

    training = researcher.post(
        "/research/jobs/new/diloco-train",
        {"dataset": "corpus", "architecture": "rnn", "rounds": 5, "inner_lr": 0},
        form="/research/jobs/new?kind=diloco-train",
    )
    assert training.status_code == 422
    assert "transformer-lm" in _field_error(training.text, "architecture")
    assert "greater than 0" in _field_error(training.text, "inner_lr")
    assert 'value="5"' in training.text


def test_sign_up_team_and_node_forms_come_back_too(api: Api) -> None:
    browser = Browser(api.client)
    long_name = "n" * 300
    page = browser.post(
        "/signup", {"username": long_name, "email": "x@example.org", "password": "p" * 12}
    )
    assert page.status_code == 422 and 'action="/signup"' in page.text
    assert "at most 200 characters" in _field_error(page.text, "username")
    assert 'value="x@example.org"' in page.text and "p" * 12 not in page.text  # never the password
    assert browser.sign_up("gale").status_code == 303
    team = browser.post("/teams/new", {"name": long_name})
    assert team.status_code == 422 and "at most 200 characters" in _field_error(team.text, "name")
    node = browser.post("/my/nodes/add", {"name": long_name})
    assert node.status_code == 422 and 'action="/my/nodes/add"' in node.text
    assert "at most 200 characters" in _field_error(node.text, "name")


def test_summary_names_the_fields() -> None:
    assert summary({"shard_size": "x"}) == "Check the field marked below: shard size."
    assert summary({"a": "x", "b": "y"}) == "Check the fields marked below: a, b."
