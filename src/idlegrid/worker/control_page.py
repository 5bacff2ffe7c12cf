"""The control page's HTML: self-contained documents (no CDN, no framework) in the
dashboard's look (its colours, header, cards and badges).

PAGE polls /api/status every second and posts the owner's controls; the token travels in
the same-site cookie that `/?token=...` or the sign-in form set. SIGN_IN asks for the
token when a browser comes without it.
"""

from html import escape

STYLE = """<style>
 :root { --bg: #f6f7fb; --card: #fff; --ink: #1c2333; --muted: #5b6476; --line: #e2e6ef;
  --brand: #2f5bea; --brand-soft: #e8eeff; --ok: #137a3f; --ok-soft: #e3f5ea;
  --warn: #8a5a00; --warn-soft: #fff4db; --bad: #b42318; --bad-soft: #fdecea;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  color: var(--ink); background: var(--bg); line-height: 1.5; }
 * { box-sizing: border-box; } body { margin: 0; }
 .top { background: #121a2f; color: #fff; }
 .wrap { max-width: 980px; margin: 0 auto; padding: 0 1.2rem; }
 .top .wrap { display: flex; align-items: center; gap: 1rem; min-height: 58px; }
 .brand { font-weight: 700; font-size: 1.2rem; display: flex; align-items: center; gap: .5rem; }
 .logo { width: 22px; height: 22px; border-radius: 6px; display: inline-block;
  background: conic-gradient(#5b8cff, #34d399, #fbbf24, #5b8cff); }
 .top .muted { color: #d5dcf0; }
 h1 { font-size: 1.5rem; margin: 1.2rem 0 .6rem; } h2 { font-size: 1.1rem; margin: 0 0 .7rem; }
 .card { background: var(--card); border: 1px solid var(--line); border-radius: 10px;
  padding: 1.1rem 1.2rem; margin: 0 0 1rem; box-shadow: 0 1px 2px rgba(16, 24, 40, .04); }
 .narrow { max-width: 480px; margin: 2rem auto; }
 .muted { color: var(--muted); }
 .badge { display: inline-block; padding: .1rem .6rem; border-radius: 999px; font-size: .85rem;
  font-weight: 600; background: #eef0f5; color: #3d4556; }
 .running { background: var(--ok-soft); color: var(--ok); }
 .paused { background: var(--warn-soft); color: var(--warn); }
 .throttled { background: var(--brand-soft); color: var(--brand); }
 .stats { display: grid; gap: 1rem; grid-template-columns: repeat(auto-fit, minmax(180px, 1fr));
  margin-bottom: 1rem; }
 .stats .card { margin: 0; } .label { color: var(--muted); font-size: .8rem;
  text-transform: uppercase; letter-spacing: .04em; display: block; }
 .value { font-size: 1.5rem; font-weight: 700; font-variant-numeric: tabular-nums; }
 table { border-collapse: collapse; width: 100%; font-size: .93rem; }
 td, th { text-align: left; padding: .4rem .5rem; border-bottom: 1px solid var(--line); }
 th { color: var(--muted); font-weight: 600; font-size: .85rem; }
 progress { width: 8rem; }
 button { font: inherit; font-weight: 600; background: var(--brand); color: #fff;
  border: 1px solid var(--brand); border-radius: 7px; padding: .45rem .9rem; cursor: pointer;
  margin: 0 .3rem .3rem 0; }
 button.ghost { background: #fff; color: var(--brand); }
 label { font-weight: 600; font-size: .92rem; display: flex; flex-direction: column; gap: .25rem; }
 .fields { display: grid; gap: .8rem 1rem; margin-bottom: .8rem;
  grid-template-columns: repeat(auto-fit, minmax(190px, 1fr)); }
 input, select { font: inherit; padding: .45rem .6rem; border: 1px solid #c5cbd8;
  border-radius: 7px; background: #fff; color: var(--ink); width: 100%; }
 input::placeholder { color: #9aa3b5; font-style: italic; }
 small { font-weight: 400; color: var(--muted); font-size: .8rem; }
 .error { color: var(--bad); } .saved { color: var(--ok); }
 p.error:not(:empty) { background: var(--bad-soft); padding: .6rem .9rem; border-radius: 8px; }
 code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: .9em; }
</style>"""

HEAD = (
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · idlegrid worker</title>
"""
    + STYLE
    + """</head>
<body>
<header class="top"><div class="wrap"><span class="brand"><span class="logo"></span>idlegrid</span>
<span class="muted">this machine's worker</span></div></header>
<main class="wrap">
"""
)


def sign_in(state_dir: str, error: str = "") -> str:
    """The page a browser gets without the control token: a form that asks for it."""
    alert = f'<p class="error" role="alert">{escape(error, quote=False)}</p>' if error else ""
    return (
        HEAD.replace("{title}", "Sign in")
        + f"""<section class="card narrow">
<h1>Sign in to this worker</h1>
{alert}
<p>This page controls the idlegrid worker on this machine. Its address with the token is
printed by <code>idlegrid worker status</code>; the token alone is in
<code>{escape(state_dir)}/control-token</code>, which only you can read.</p>
<form method="post" action="/signin">
<label for="token">Control token
<input id="token" name="token" type="password" autocomplete="off" required
  placeholder="the contents of control-token"></label>
<p><button type="submit">Sign in</button></p>
</form></section></main></body></html>
"""
    )


PAGE = (
    HEAD.replace("{title}", "Control")
    + """<h1>This machine's worker <span id="state" class="badge">…</span></h1>
<p id="reason" class="lead"></p>
<div class="stats">
 <div class="card"><span class="label">Credit</span><span class="value" id="credit">…</span>
  <small>validated work, as the coordinator counts it</small></div>
 <div class="card"><span class="label">Tasks completed</span>
  <span class="value" id="completed">…</span>
  <small id="outbox"></small></div>
 <div class="card"><span class="label">Idle detection</span><span id="idle">…</span></div>
</div>
<section class="card">
 <button id="pause">Pause</button><button id="resume">Resume</button>
 <button id="finish" class="ghost">Finish current tasks, then pause</button>
 <button id="snooze" class="ghost">Snooze 1 hour</button>
</section>
<section class="card">
<h2>Settings</h2>
<form id="settings">
 <div class="fields">
 <label>CPU <select name="cpu_mode"><option>always</option><option>idle</option>
  <option>never</option></select><small>when tasks may use it</small></label>
 <label>GPU <select name="gpu_mode"><option>always</option><option>idle</option>
  <option>never</option></select><small>when tasks may use it</small></label>
 <label>CPU % when idle <input name="cpu_percent" type="number" min="1" max="100">
  <small>of the cores tasks may use</small></label>
 <label>CPU % in use <input name="in_use_cpu_percent" type="number" min="1" max="100">
  <small>while you use the machine (mode always)</small></label>
 <label>Time windows <input name="windows" placeholder="any time (e.g. 18:00-08:00)">
  <small>when tasks may run; empty: any time</small></label>
 </div>
 <button type="submit">Save</button> <span id="saved" class="saved" role="status"></span>
 <p id="error" class="error" role="alert"></p>
</form>
<p id="settings-error" class="error"></p>
<details id="sources-box"><summary>Where each setting came from</summary>
<table><thead><tr><th>setting</th><th>value</th><th>set on</th><th>by</th><th>when</th></tr>
</thead><tbody id="sources"></tbody></table>
<p><small>The later change wins, setting by setting, whether made here or on the
dashboard.</small></p></details>
</section>
<section class="card">
<h2>Devices</h2>
<table><thead><tr><th>device</th><th>state</th><th>why</th><th>tasks</th><th></th></tr>
</thead><tbody id="devices"></tbody></table>
</section>
<section class="card">
<h2>Tasks</h2>
<table><thead><tr><th>task</th><th>kind</th><th>job</th><th>state</th><th>progress</th></tr>
</thead><tbody id="tasks"></tbody></table>
</section>
<section class="card"><h2>This machine</h2><p id="hardware"></p></section>
</main>
<script>
const $ = (id) => document.getElementById(id);
let editing = false, shown = {};
async function call(path, body) {
  const response = await fetch(path, {method: body === undefined ? "GET" : "POST",
    headers: {"Content-Type": "application/json"},
    body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}
function show(s) {
  // The badge says the state; the line beside it says why, once.
  $("state").textContent = s.state; $("state").className = "badge " + s.state;
  $("reason").textContent = s.why;
  $("idle").textContent = s.idle.probe +
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
  showDevices(s);
  $("credit").textContent = s.credit === null ? "unknown" : s.credit.toFixed(2);
  $("completed").textContent = String(s.completed);
  $("outbox").textContent = "waiting to report " + s.outbox +
    (s.connected ? "" : " (not connected to the coordinator)");
  const hw = s.hardware || {};
  $("hardware").textContent = (hw.cpu_model || "") + ", " + (hw.cpu_cores || "?") +
    " cores, " + (hw.memory_mb || "?") + " MB; device " + s.device + "; benchmark " +
    (s.benchmark.matmul_gflops || 0).toFixed(1) + " GFLOPS";
  if (!editing) {
    const form = $("settings");
    for (const name of ["cpu_mode", "gpu_mode", "cpu_percent", "in_use_cpu_percent", "windows"])
      form.elements[name].value = shown[name] = s.settings[name];
  }
  $("settings-error").textContent = s.settings_error || "";
  $("sources").replaceChildren(...Object.entries(s.sources).map(([name, stamp]) => {
    const row = document.createElement("tr");
    let value = Array.isArray(stamp.value) ? stamp.value.join(", ") : stamp.value;
    if (name === "control") value = stamp.value.action + (stamp.value.until ?
      " until " + new Date(stamp.value.until * 1000).toLocaleString() : "");
    const when = stamp.at ? new Date(stamp.at * 1000).toLocaleString() : "-";
    for (const text of [name, value, stamp.source === "web" ? "the dashboard" : "this machine",
                        stamp.by, when]) row.insertCell().textContent = String(text);
    return row;
  }));
}
// Each device on its own; a GPU can be paused alone (the setting paused_gpus).
function showDevices(s) {
  const paused = new Set(s.settings.paused_gpus || []);
  $("devices").replaceChildren(...(s.devices || []).map((d) => {
    const row = document.createElement("tr");
    row.dataset.device = d.device;
    const here = s.tasks.filter((t) => t.device === d.device).map((t) => t.task_id);
    for (const text of [d.device + " " + d.name, d.state, d.state === "paused" ? d.reason : "",
                        here.join(", ") || "-"]) row.insertCell().textContent = text;
    const cell = row.insertCell(), index = Number(d.device.split(":")[1]);
    if (d.device.includes(":")) {
      const button = document.createElement("button"), off = paused.has(index);
      button.textContent = off ? "Resume GPU" : "Pause GPU";
      button.className = "ghost"; button.dataset.gpu = String(index);
      button.onclick = async () => show(await act("/api/settings", {paused_gpus:
        off ? [...paused].filter((i) => i !== index) : [...paused, index]}));
      cell.append(button);
    }
    return row;
  }));
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
  $("settings").addEventListener(event, () => { editing = true; $("saved").textContent = ""; });
$("settings").onsubmit = async (event) => {
  event.preventDefault();
  const form = event.target, values = {};
  // Only what the owner changed: a setting left alone keeps its source (and a later
  // change on the dashboard is not undone by saving another one here).
  for (const name of ["cpu_mode", "gpu_mode", "windows", "cpu_percent", "in_use_cpu_percent"]) {
    const raw = form.elements[name].value;
    const value = name.endsWith("percent") ? Number(raw) : raw;
    if (value !== shown[name]) values[name] = value;
  }
  try {
    const s = await act("/api/settings", values);
    editing = false; show(s); $("error").textContent = "";
    $("saved").textContent = "Saved at " + new Date().toLocaleTimeString() + ".";
  } catch (e) { $("saved").textContent = ""; $("error").textContent = e.message; }
};
refresh(); setInterval(refresh, 1000);
</script>
</body></html>
"""
)
