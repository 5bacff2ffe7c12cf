"""A volunteer's nodes controlled from the dashboard, under TestClient with a node that
speaks the protocol by hand: controls and settings reach it over its WebSocket (or after
its next welcome), bad values are refused with the reason, other people's nodes are 404,
and "my nodes" shows what each node is doing."""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import Api, off_loop
from helpers import NODE_WS as WS
from helpers import SocketNode as Node
from test_dashboard import Browser, _set_login

from idlegrid.kinds.sleep import _digest


@pytest.fixture
def browser(api: Api) -> Browser:
    return Browser(api.client)


def _node_token(browser: Browser, name: str) -> str:
    added = browser.post("/my/nodes/add", {"name": name})
    secret = re.search(r'<code id="node-token">([^<]+)</code>', added.text)
    assert secret is not None
    return secret.group(1)


def _store(api: Api) -> Any:
    return api.client.app.state.grid.store  # type: ignore[attr-defined]


def _call(api: Api, function: Any, *args: Any, **kwargs: Any) -> Any:
    """An async store call on the app's own event loop."""

    async def run() -> Any:
        return await function(*args, **kwargs)

    return api.client.portal.call(run)  # type: ignore[union-attr]


def test_controls_and_settings_reach_the_node(api: Api, browser: Browser) -> None:
    browser.sign_up("vera")
    token = _node_token(browser, "vera-pc")
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node_id = node.join(key="vera-pc-key", hardware={"cpu_cores": 4, "memory_mb": 8192})[
            "node_id"
        ]
        moved = browser.post(f"/my/nodes/{node_id}/control", {"action": "pause"}, form="/my/nodes")
        assert moved.status_code == 303
        sent = node.expect("settings")["settings"]
        assert sent["control"]["value"] == {"action": "pause", "until": None}
        assert sent["control"]["source"] == "web" and sent["control"]["by"] == "vera"

        form = f"/my/nodes/{node_id}/settings"
        saved = browser.post(form, {"cpu_percent": "40", "cpu_cores": "2", "windows": "18:00-08:00",
                                    "exclusive_apps": "steam, blender", "daily_download_mb": "500",
                                    "memory_percent": "60", "cpu_mode": "always"})  # fmt: skip
        assert saved.status_code == 303
        sent = node.expect("settings")["settings"]
        assert sent["cpu_percent"]["value"] == 40.0 and sent["cpu_cores"]["value"] == 2
        assert sent["exclusive_apps"]["value"] == ["steam", "blender"]
        assert sent["windows"]["value"] == "18:00-08:00" and sent["cpu_mode"]["value"] == "always"

        # What the node cannot apply is refused with the reason, and nothing is stored.
        for values, reason in [
            ({"cpu_percent": "150"}, "cpu_percent: Input should be less than or equal to 100"),
            ({"cpu_cores": "64"}, "cpu_cores: 64 is more than this node&#39;s 4 cores"),
            ({"windows": "10:00-10:00"}, "ends when it starts"),
            ({"windows": "17:00-9"}, "is not [days] HH:MM-HH:MM"),
            ({"daily_download_mb": "lots"}, "daily_download_mb: &#39;lots&#39; is not a number"),
            ({"cpu_percent": "30", "cpu_cores": "0.5"}, "cpu_cores: &#39;0.5&#39; is not a whole"),
        ]:
            refused = browser.post(form, values)
            assert refused.status_code == 422, values
            assert reason in refused.text and "The node keeps its settings" in refused.text
        rows = _call(api, _store(api).node_control.settings_of, [node_id])[node_id]
        assert rows["cpu_percent"].value == 40.0 and rows["cpu_cores"].value == 2
        node.sync()  # no settings frame came for the refused changes

        # The node reports what it runs; its own newer edit wins and shows as local.
        node.send(type="settings_report", settings={
            "cpu_percent": {"value": 70, "source": "local", "by": "local page", "at": 4e9},
            "cpu_mode": {"value": "idle", "source": "local", "by": "", "at": 0},
            "in_use_cpu_percent": {"value": 50, "source": "local", "by": "", "at": 0},
        }, error="")  # fmt: skip
        node.send(type="status", state="paused", reason="paused by the owner", device="cpu")
        node.sync()
        page = browser.get(form).text
        assert re.search(r'data-setting="cpu_percent" data-source="local"', page)
        assert re.search(r'data-setting="cpu_cores" data-source="web"', page)
        # Never changed anywhere: the node's own configuration, shown in the form.
        assert re.search(
            r"in_use_cpu_percent</td>\s*<td><code>50</code></td>\s*<td>the node's configuration",
            page,
        )
        assert 'name="in_use_cpu_percent" inputmode="decimal" value="50"' in page
        mine = browser.get("/my/nodes").text
        assert "paused by the owner" in mine and "on cpu" in mine and "asked: pause" in mine


def test_a_node_that_was_offline_gets_its_settings_on_reconnect(api: Api, browser: Browser) -> None:
    browser.sign_up("otto")
    token = _node_token(browser, "otto-pc")
    with api.client.websocket_connect(WS) as ws:
        node_id = Node(api, ws, token).join(key="otto-pc-key")["node_id"]
    changed = browser.post(f"/my/nodes/{node_id}/settings", {"cpu_percent": "25"})
    assert changed.status_code == 303
    browser.post("/my/nodes/control", {"action": "snooze"}, form="/my/nodes")
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node.join(key="otto-pc-key")
        sent = node.expect("settings")["settings"]
        assert sent["cpu_percent"]["value"] == 25.0
        assert sent["control"]["value"]["action"] == "snooze"
        # A node that cannot apply them says so, and both pages show it.
        node.send(type="settings_report", settings={},
                  error="could not apply the dashboard's settings: cpu_percent: no")  # fmt: skip
        node.sync()
    page = browser.get(f"/my/nodes/{node_id}/settings").text
    assert "could not apply" in page
    for path in ("/my/nodes", f"/my/nodes/{node_id}/settings"):
        assert "could not apply the dashboard&#39;s settings" in browser.get(path).text


def test_only_the_owner_or_an_admin_may_change_a_node(api: Api, browser: Browser) -> None:
    browser.sign_up("nina")
    token = _node_token(browser, "nina-pc")
    with api.client.websocket_connect(WS) as ws:
        node_id = Node(api, ws, token).join(key="nina-pc-key")["node_id"]
    stranger = Browser(api.client)
    stranger.sign_up("mallory")
    assert stranger.get(f"/my/nodes/{node_id}/settings").status_code == 404
    for path, data in [
        (f"/my/nodes/{node_id}/control", {"action": "pause"}),
        (f"/my/nodes/{node_id}/settings", {"cpu_percent": "10"}),
        ("/my/nodes/999999/control", {"action": "pause"}),
    ]:
        assert stranger.post(path, data, form="/my/nodes").status_code == 404, path
    # "all" means the asker's own nodes: mallory has none, nina's stays as it was.
    assert (
        stranger.post("/my/nodes/control", {"action": "pause"}, form="/my/nodes").status_code == 303
    )
    assert _call(api, _store(api).node_control.settings_of, [node_id])[node_id] == {}
    off_loop(_set_login(api, "root", "admin"))
    admin = Browser(api.client)
    assert admin.sign_in("root").status_code == 303
    form = f"/my/nodes/{node_id}/settings"
    assert admin.post(form, {"cpu_percent": "10"}).status_code == 303
    assert "root (admin)" in admin.get(form).text


def test_my_nodes_shows_what_each_node_does(api: Api, browser: Browser) -> None:
    browser.sign_up("wes")
    token = _node_token(browser, "wes-pc")
    researcher = api.token(account="lab")
    api.submit(researcher, kind="sleep", params={"tasks": 2})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node_id = node.join(key="wes-pc-key", slots=2)["node_id"]
        node.ready(free_slots=2)
        first, second = node.expect("assign"), node.expect("assign")
        node.send(type="heartbeat", running=[{"task_id": second["task_id"], "progress": 0.5}])
        node.expect("heartbeat_ack")
        node.result(first["task_id"], _digest(first["shard_index"]))
        node.expect("result_ack", status="accepted")
        row = _row(browser.get("/my/nodes").text, node_id)
        assert f"task {second['task_id']}" in row and 'value="0.5"' in row and "50%" in row
        assert re.search(r'credit-today">[^<]*[1-9]', row)  # the validated result of today
    row = _row(browser.get("/my/nodes").text, node_id)
    assert "offline" in row and "silent" not in row
    # A node not heard from for a day is marked silent.
    _call(api, _age, _store(api), node_id, 2 * 86_400)
    row = _row(browser.get("/my/nodes").text, node_id)
    assert "silent for 2 d" in row


def _row(page: str, node_id: int) -> str:
    found = re.search(rf'<tr id="node-{node_id}".*?</tr>', page, re.S)
    assert found, page
    return found.group(0)


async def _age(store: Any, node_id: int, seconds: float) -> None:
    from sqlalchemy import update

    from idlegrid.store.schema import nodes

    async with store.db.tx() as conn:
        await conn.execute(
            update(nodes)
            .where(nodes.c.id == node_id)
            .values(last_seen_at=nodes.c.last_seen_at - seconds)
        )
