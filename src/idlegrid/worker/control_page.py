"""The control page's HTML: one self-contained document (no CDN, no framework).

It polls /api/status every second and posts the owner's controls; the token travels in
the same-site cookie that `/?token=...` set.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>idlegrid worker</title>
<style>
 body { font: 15px/1.4 system-ui, sans-serif; margin: 2rem auto; max-width: 52rem; color: #222; }
 h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 1.6rem; }
 #state { font-weight: 600; padding: .2rem .6rem; border-radius: .3rem; }
 .running { background: #d8f5d0; } .paused { background: #fde2c8; }
 .throttled { background: #fff3b8; }
 table { border-collapse: collapse; width: 100%; }
 td, th { text-align: left; padding: .25rem .5rem; border-bottom: 1px solid #ddd; }
 progress { width: 10rem; } button { margin: 0 .3rem .3rem 0; padding: .3rem .8rem; }
 label { display: inline-block; margin: 0 1rem .5rem 0; } #error { color: #a00; }
</style></head>
<body>
<h1>idlegrid worker</h1>
<p><span id="state">…</span> <span id="reason"></span></p>
<p id="idle"></p>
<div>
 <button id="pause">Pause</button><button id="resume">Resume</button>
 <button id="finish">Finish current tasks, then pause</button>
 <button id="snooze">Snooze 1 hour</button>
</div>
<h2>Settings</h2>
<form id="settings">
 <label>CPU <select name="cpu_mode"><option>always</option><option>idle</option>
  <option>never</option></select></label>
 <label>GPU <select name="gpu_mode"><option>always</option><option>idle</option>
  <option>never</option></select></label>
 <label>CPU % when idle <input name="cpu_percent" type="number" min="1" max="100"></label>
 <label>CPU % in use <input name="in_use_cpu_percent" type="number" min="1" max="100"></label>
 <label>Time windows <input name="windows" size="34"
   placeholder="18:00-08:00; sat,sun 00:00-24:00"></label>
 <button type="submit">Save</button> <span id="error"></span>
</form>
<h2>Tasks</h2>
<table><thead><tr><th>task</th><th>kind</th><th>job</th><th>state</th><th>progress</th></tr>
</thead><tbody id="tasks"></tbody></table>
<p id="totals"></p>
<h2>This machine</h2>
<p id="hardware"></p>
<script>
const $ = (id) => document.getElementById(id);
let editing = false;
async function call(path, body) {
  const response = await fetch(path, {method: body === undefined ? "GET" : "POST",
    headers: {"Content-Type": "application/json"},
    body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}
function show(s) {
  $("state").textContent = s.state; $("state").className = s.state;
  $("reason").textContent = s.reason;
  $("idle").textContent = "idle detection: " + s.idle.probe +
    (s.idle.seconds === null ? " (cannot tell)" : ", idle " + Math.round(s.idle.seconds) + " s");
  // Built as nodes, not HTML: what the coordinator sent is shown, never run.
  const rows = s.tasks.map((t) => {
    const row = document.createElement("tr");
    for (const value of [t.task_id, t.kind, t.job_id, t.state]) {
      const cell = row.insertCell(); cell.textContent = String(value);
    }
    const bar = document.createElement("progress");
    bar.max = 1; bar.value = t.progress;
    const cell = row.insertCell();
    cell.append(bar, " " + Math.round(100 * t.progress) + "%");
    return row;
  });
  if (!rows.length) {
    const row = document.createElement("tr"), cell = row.insertCell();
    cell.colSpan = 5; cell.textContent = "no tasks"; rows.push(row);
  }
  $("tasks").replaceChildren(...rows);
  $("totals").textContent = "completed " + s.completed + ", waiting to report " + s.outbox +
    ", credit " + (s.credit === null ? "unknown" : s.credit.toFixed(2)) +
    (s.connected ? "" : " (not connected to the coordinator)");
  const hw = s.hardware || {};
  $("hardware").textContent = (hw.cpu_model || "") + ", " + (hw.cpu_cores || "?") +
    " cores, " + (hw.memory_mb || "?") + " MB; device " + s.device + "; benchmark " +
    (s.benchmark.matmul_gflops || 0).toFixed(1) + " GFLOPS";
  if (!editing) {
    const form = $("settings");
    for (const name of ["cpu_mode", "gpu_mode", "cpu_percent", "in_use_cpu_percent", "windows"])
      form.elements[name].value = s.settings[name];
  }
}
// A status read that was on its way while an action ran is older than the action's answer:
// it is dropped, so it cannot put back what the owner just changed.
let actions = 0;
async function refresh() {
  const before = actions;
  try { const s = await call("/api/status"); if (before === actions) show(s); } catch (e) {}
}
async function act(path, body) {
  actions += 1;
  try { return await call(path, body); } finally { actions += 1; }
}
for (const action of ["pause", "resume", "finish", "snooze"])
  $(action).onclick = async () => show(await act("/api/" + action, {}));
// Any touch of the form (focus, typing, a choice) keeps the refresh off its fields until the
// owner saves, so what they typed is what is sent.
for (const event of ["focusin", "input", "change"])
  $("settings").addEventListener(event, () => { editing = true; });
$("settings").onsubmit = async (event) => {
  event.preventDefault();
  const form = event.target, values = {};
  for (const name of ["cpu_mode", "gpu_mode", "windows"]) values[name] = form.elements[name].value;
  for (const name of ["cpu_percent", "in_use_cpu_percent"])
    values[name] = Number(form.elements[name].value);
  try {
    const s = await act("/api/settings", values);
    editing = false; show(s); $("error").textContent = "";
  } catch (e) { $("error").textContent = e.message; }
};
refresh(); setInterval(refresh, 1000);
</script>
</body></html>
"""
