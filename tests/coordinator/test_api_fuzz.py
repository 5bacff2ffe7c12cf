"""Schemathesis against the spec a real `idlegrid serve` serves, as three callers.

Generated requests (valid and invalid) go to every operation as a researcher, as a node
and anonymously; the test fails on any 5xx and on any answer the spec does not declare
(status, content type, headers, body schema). The number of examples bounds its time.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from helpers import wait_until
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 16
CALLERS = ("researcher", "node", "anonymous")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGrid]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    with LocalGrid(root) as local:  # starts `idlegrid serve`
        yield local


@pytest.fixture(scope="module")
def tokens(served: LocalGrid) -> dict[str, str]:
    return {
        "researcher": served.create_token(account="fuzz-researcher")["token"],
        "node": served.create_token(account="fuzz-volunteer", kind="node")["token"],
    }


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


# Bodies the spec cannot fully describe, where a schema-valid request may still be refused
# with a 422 that says why: a job's `params` are checked by its kind (each kind its own
# model), and a blob's content must hash to its path.
CONTENT_CHECKED = {("POST", "/v1/jobs"), ("PUT", "/v1/blobs/{blob_hash}")}


@pytest.mark.parametrize("caller", CALLERS)
def test_the_api_answers_as_its_spec_says(
    caller: str, served: LocalGrid, tokens: dict[str, str], http: requests.Session
) -> None:
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    headers = {"Authorization": f"Bearer {tokens[caller]}"} if caller in tokens else {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures = []
    for operation in operations:
        try:
            _fuzz(operation, base_url=served.url, session=http, headers=headers)
        except Exception as exc:  # every operation's failures, not only the first's
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)


def _fuzz(operation: Any, **call: Any) -> None:
    """Run one operation's examples: requests that fit the spec and requests that break it
    (which must be refused), every answer checked against the spec."""
    key = (operation.method.upper(), operation.path)
    excluded = [positive_data_acceptance] if key in CONTENT_CHECKED else []
    strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
        GenerationMode.NEGATIVE
    )

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def answers_as_declared(case: schemathesis.Case) -> None:
        case.call_and_validate(excluded_checks=excluded, **call)

    answers_as_declared()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs?offset=99999999999999999999"),
        ("GET", "/v1/jobs/9223372036854775808"),
        ("POST", "/v1/jobs/9223372036854775808/cancel"),
        ("GET", "/v1/jobs/2147483648"),
        ("DELETE", "/v1/tokens/9223372036854775808"),
        ("GET", "/v1/nodes/9223372036854775808/trust"),
        ("GET", "/v1/blobs/" + "0" * 64 + "?x=1"),
    ],
)
def test_integers_past_the_store_are_refused_not_500(
    method: str, path: str, served: LocalGrid, tokens: dict[str, str], http: requests.Session
) -> None:
    headers = {"Authorization": f"Bearer {tokens['researcher']}"}
    response = http.request(method, served.url + path, headers=headers)
    assert response.status_code in (404, 422), response.text
    assert set(response.json()) == {"error", "message"}


def test_a_wrong_method_is_405_with_allow(served: LocalGrid, http: requests.Session) -> None:
    response = http.patch(f"{served.url}/v1/jobs")
    assert response.status_code == 405
    assert set(response.headers["Allow"].replace(" ", "").split(",")) == {"GET", "POST"}


def test_a_client_leaving_mid_upload_is_one_log_line(served: LocalGrid) -> None:
    blob_hash = "ab" * 32
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    partial = served.data_dir / "blobs" / "tmp"
    # Chunked uploads of other tests keep their partial files (they go on later).
    before = set(partial.iterdir()) if partial.exists() else set()
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(
            f"PUT /v1/blobs/{blob_hash} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {served.admin_token}\r\n"
            "Content-Length: 1000000\r\n\r\n".encode()
            + b"x" * 65536
        )
        # The coordinator is streaming the body into a partial file.
        wait_until(lambda: set(partial.iterdir()) - before, "the upload to start")
    log = served.root / "coordinator.log"
    wait_until(lambda: blob_hash in log.read_text(), "the upload's log line")
    time.sleep(0.5)  # time for a second line to prove there is none: no state to wait on
    lines = [line for line in log.read_text().splitlines() if blob_hash in line]
    assert len(lines) == 1 and "client went away" in lines[0], lines
    assert "Traceback" not in log.read_text()
    assert not set(partial.iterdir()) - before  # no partial file left


@pytest.mark.parametrize("path", ["/nodes/{}", "/users/{}", "/teams/{}"])
def test_dashboard_ids_past_the_store_are_refused_not_500(
    path: str, served: LocalGrid, http: requests.Session
) -> None:
    response = http.get(served.url + path.format(2**63))
    assert response.status_code == 422, response.text
