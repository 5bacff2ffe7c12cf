"""Each GPU of a node on its own, from the web: the coordinator sends a task that needs a
GPU only to a free GPU slot, "my nodes" shows each device (its state, why, its tasks), one
GPU can be paused from the dashboard, and an index the node does not have is refused
with a 422 that names it. The node speaks the protocol by hand (TestClient)."""

from __future__ import annotations

import re

import pytest
from conftest import Api
from helpers import NODE_WS as WS
from helpers import SocketNode as Node
from test_dashboard import Browser
from test_node_controls import _call, _node_token, _row, _store

TWO_GPUS = {
    "cpu_cores": 4, "memory_mb": 16384,
    "gpus": [{"index": 0, "backend": "cuda", "name": "RTX 4090", "memory_mb": 24564},
             {"index": 1, "backend": "cuda", "name": "RTX A2000", "memory_mb": 6138}],
}  # fmt: skip


@pytest.fixture
def browser(api: Api) -> Browser:
    return Browser(api.client)


def test_a_task_that_needs_a_gpu_goes_only_to_a_free_gpu_slot(api: Api, browser: Browser) -> None:
    browser.sign_up("gia")
    token = _node_token(browser, "gia-rig")
    researcher = api.token(account="lab")
    api.submit(researcher, kind="sleep", params={"tasks": 2, "backend": "cuda"})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node.join(key="gia-rig-key", slots=3, hardware=TWO_GPUS)
        node.send(type="ready", free_slots=1, free_gpu_slots=0)  # its CPU slot only
        node.sync()  # nothing was sent for it
        node.send(type="ready", free_slots=3, free_gpu_slots=1)
        assign = node.expect("assign", gpu=True)
        node.sync()  # one GPU slot free: one task, though three slots are
        assert assign["kind"] == "sleep"


def test_each_device_shows_and_one_gpu_pauses_from_the_web(api: Api, browser: Browser) -> None:
    browser.sign_up("ravi")
    token = _node_token(browser, "ravi-rig")
    api.submit(api.token(account="lab"), kind="sleep", params={"tasks": 1, "backend": "cuda"})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node_id = node.join(key="ravi-rig-key", slots=3, hardware=TWO_GPUS)["node_id"]
        node.send(type="ready", free_slots=3, free_gpu_slots=1)
        task_id = node.expect("assign", gpu=True)["task_id"]
        node.send(type="status", state="running", reason="running: idle for 5 min", devices=[
            {"device": "cuda:0", "name": "RTX 4090", "state": "running"},
            {"device": "cuda:1", "name": "RTX A2000", "state": "paused",
             "reason": "other programs use 80% of GPU 1"},
            {"device": "cpu", "name": "Ryzen", "state": "running", "reason": ""},
        ])  # fmt: skip
        node.send(type="heartbeat", running=[{"task_id": task_id, "progress": 0.5,
                                              "device": "cuda:0"}])  # fmt: skip
        node.expect("heartbeat_ack")
        row = _row(browser.get("/my/nodes").text, node_id)
        gpu1 = re.search(r'<li class="device" data-device="cuda:1" data-state="paused">.*?</li>',
                         row, re.S)  # fmt: skip
        gpu0 = re.search(r'<li class="device" data-device="cuda:0".*?</li>', row, re.S)
        assert gpu1 and "other programs use 80% of GPU 1" in gpu1.group(0)
        assert gpu0 and f"task {task_id}" in gpu0.group(0)  # which device runs what
        assert "on cuda:0" in row and 'data-gpu="1"' in row and "Pause GPU" in gpu1.group(0)

        paused = browser.post(f"/my/nodes/{node_id}/gpus/1", {"action": "pause"}, form="/my/nodes")
        assert paused.status_code == 303
        sent = node.expect("settings")["settings"]
        assert sent["paused_gpus"]["value"] == [1] and sent["paused_gpus"]["by"] == "ravi"
        assert "Resume GPU" in _row(browser.get("/my/nodes").text, node_id)

        # An index the node does not have: refused with the reason, nothing stored or sent.
        refused = browser.post(f"/my/nodes/{node_id}/gpus/5", {"action": "pause"},
                               form="/my/nodes")  # fmt: skip
        assert refused.status_code == 422
        assert "paused_gpus: this node has no GPU 5 (its GPUs: 0, 1)" in refused.text
        form = f"/my/nodes/{node_id}/settings"
        refused = browser.post(form, {"paused_gpus": "0, 7"})
        assert refused.status_code == 422 and "has no GPU 7" in refused.text
        assert browser.post(form, {"paused_gpus": "x"}).status_code == 422
        rows = _call(api, _store(api).node_control.settings_of, [node_id])[node_id]
        assert rows["paused_gpus"].value == [1]
        node.sync()  # no settings frame came for the refused changes

        resumed = browser.post(f"/my/nodes/{node_id}/gpus/1", {"action": "run"}, form="/my/nodes")
        assert resumed.status_code == 303
        assert node.expect("settings")["settings"]["paused_gpus"]["value"] == []
