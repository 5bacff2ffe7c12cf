"""idlegrid's peer-to-peer all-reduce against Hivemind's own compressed averaging, on the
same group, vectors and machine: bytes on the wire, time a step, and whether the members
end with the same mean.

    PYTHONPATH=src .venv/bin/python benchmarks/p2p_vs_hivemind.py [--members 4]
        [--params 117479] [--rounds 5]

K member processes (spawned) join one DHT (a bootstrap peer in this process) and average
a fresh vector each round (float32, normal, a different seed per member and round):

- `idlegrid`: the standing averager's own path (`averaging.Server`, `attempts.attempt_all`:
  the meeting in the DHT, then the all-reduce with int8 codes under shared scales and
  exact sums), the job's default compression;
- `hivemind-float16` and `hivemind-uint8`: `hivemind.averaging.DecentralizedAverager`
  (Hivemind 1.1.12's butterfly all-reduce) with `Float16Compression` or
  `Uniform8BitQuantization` on the wire both ways, `target_group_size` and
  `min_group_size` K, `min_matchmaking_time` 1 s. (With numpy 2, Hivemind 1.1.12's 8-bit
  codecs fail to decode a part, `int()` of a one-element array, which its all-reduce logs
  at debug level only: every member keeps its own vector. The benchmark shows it.)

Per engine it prints, a member a round: the bytes on the loopback interface while the
round ran (every member's traffic, both directions, the DHT's, libp2p's framing and
encryption and TCP/IP headers included; this machine's other loopback traffic too) over
K; the wall time of the step; how many distinct means the members read back (1: every
member holds the same bytes); and the largest difference between a member's mean and
the exact float64 mean, over the exact mean's RMS. Last line:
`bytes_ratio: B time_ratio: T idlegrid_means: 1 hivemind_means: M` (idlegrid over
Hivemind with float16, the strongest of its codecs that averages on this stack).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import time
from typing import Any

import numpy as np
import psutil

ENGINES = ("idlegrid", "hivemind-float16", "hivemind-uint8")


def vector(member: int, round_: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * round_ + member)
    return (0.01 * rng.normal(size=size)).astype(np.float32)


def idlegrid_member(member: int, peers: list[str], options: dict[str, Any],
                    barrier: Any, results: Any) -> None:  # fmt: skip
    from idlegrid.p2p import attempts, seal
    from idlegrid.p2p.averaging import Server
    from idlegrid.p2p.group import Group
    from idlegrid.training.compression import Compression

    server = Server(peers, "public")
    settings = Compression(method="int8")
    members = tuple(range(options["members"]))
    for round_ in range(options["rounds"]):
        key = f"bench-{options['run']}-round{round_}"
        group = Group(key, members, len(members), 60.0, tuple(peers),
                      secret=seal.round_secret(b"k" * 32, key))  # fmt: skip
        values = vector(member, round_, options["params"])
        barrier.wait()
        started = time.perf_counter()
        outcome = attempts.attempt_all(server, values, group, member, True, settings)
        elapsed = time.perf_counter() - started
        mean = outcome.mean if outcome.mean is not None else np.zeros_like(values)
        results.put((member, round_, elapsed, mean.astype(np.float32).tobytes(), outcome.reason))
        barrier.wait()
    barrier.wait()


def hivemind_member(member: int, peers: list[str], options: dict[str, Any],
                    barrier: Any, results: Any) -> None:  # fmt: skip
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, Uniform8BitQuantization

    # A spawned child's processes are spawned too, and Hivemind's averager forks (as it
    # does in a plain script).
    multiprocessing.set_start_method("fork", force=True)
    dht = hivemind.DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = DecentralizedAverager(
        averaged_tensors=[torch.zeros(options["params"])], dht=dht,
        prefix=f"bench-{options['run']}-{options['engine']}",
        target_group_size=options["members"], min_group_size=options["members"],
        min_matchmaking_time=1.0, request_timeout=3.0, start=True,
        compression=Uniform8BitQuantization() if options["engine"].endswith("uint8")
        else Float16Compression(),
    )  # fmt: skip
    for round_ in range(options["rounds"]):
        values = vector(member, round_, options["params"])
        with averager.get_tensors() as tensors:
            tensors[0][...] = torch.from_numpy(values)
        barrier.wait()
        started = time.perf_counter()
        done = averager.step(timeout=120)
        elapsed = time.perf_counter() - started
        with averager.get_tensors() as tensors:
            mean = tensors[0].numpy().astype(np.float32).copy()
        reason = "" if done is not None else "no group"
        results.put((member, round_, elapsed, mean.tobytes(), reason))
        barrier.wait()
    barrier.wait()
    averager.shutdown()
    dht.shutdown()


def loopback_bytes() -> int:
    counters = psutil.net_io_counters(pernic=True)["lo"]
    return int(counters.bytes_sent)


def run_engine(engine: str, peers: list[str], options: dict[str, Any]) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    k = options["members"]
    barrier = context.Barrier(k + 1)
    results = context.Queue()
    target = idlegrid_member if engine == "idlegrid" else hivemind_member
    options = {**options, "engine": engine}
    processes = [context.Process(target=target, args=(m, peers, options, barrier, results))
                 for m in range(k)]  # fmt: skip
    for process in processes:
        process.start()
    rows = []
    for round_ in range(options["rounds"]):
        barrier.wait(timeout=600)  # every member is set up and holds its vector
        before = loopback_bytes()
        answers = [results.get(timeout=600) for _ in range(k)]
        moved = loopback_bytes() - before
        barrier.wait(timeout=60)
        exact = np.mean([vector(m, round_, options["params"]).astype(np.float64)
                         for m in range(k)], axis=0)  # fmt: skip
        means = [np.frombuffer(raw, np.float32) for _, _, _, raw, _ in answers]
        rms = float(np.sqrt(np.mean(exact**2)))
        rows.append({
            "round": round_,
            # On loopback every byte is sent once and received once: each counts for
            # the member that sent it and the one that received it.
            "per_member_bytes": 2 * moved / k,
            "time_s": max(elapsed for _, _, elapsed, _, _ in answers),
            "means": len({hashlib.sha256(raw).hexdigest() for _, _, _, raw, _ in answers}),
            "error": max(float(np.max(np.abs(m - exact))) for m in means) / rms,
            "failed": [reason for *_, reason in answers if reason],
        })  # fmt: skip
    barrier.wait(timeout=60)
    for process in processes:
        process.join(60)
        if process.is_alive():
            process.kill()
    return {"engine": engine, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--params", type=int, default=117_479)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    import hivemind

    bootstrap = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in bootstrap.get_visible_maddrs()]
    settings = {"members": options.members, "params": options.params,
                "rounds": options.rounds, "run": int(time.time())}  # fmt: skip
    summaries = {}
    for engine in ENGINES:
        result = run_engine(engine, peers, settings)
        print(f"{engine}: {options.members} members, {options.params} values")
        print("  round  per_member_B  B_a_value  time_s  means  max_error/rms  failed")
        for row in result["rows"]:
            print(f"  {row['round']:5d}  {row['per_member_bytes']:12.0f}  "
                  f"{row['per_member_bytes'] / options.params:9.2f}  {row['time_s']:6.2f}  "
                  f"{row['means']:5d}  {row['error']:13.5f}  "
                  f"{'; '.join(row['failed'])[:80]}")  # fmt: skip
        # Round 0 pays for each engine's first connections: the later rounds are a step.
        later = result["rows"][1:] or result["rows"]
        summaries[engine] = {
            "bytes": float(np.mean([r["per_member_bytes"] for r in later])),
            "time": float(np.mean([r["time_s"] for r in later])),
            "means": max(r["means"] for r in later),
        }  # fmt: skip
        print(f"  after round 0: {summaries[engine]['bytes'] / options.params:.2f} bytes a "
              f"value a member, {summaries[engine]['time']:.2f} s a step")  # fmt: skip
    bootstrap.shutdown()
    mine, theirs = summaries["idlegrid"], summaries["hivemind-float16"]
    print(f"bytes_ratio: {mine['bytes'] / theirs['bytes']:.2f} "
          f"time_ratio: {mine['time'] / theirs['time']:.2f} "
          f"idlegrid_means: {mine['means']} hivemind_means: {theirs['means']}")  # fmt: skip


if __name__ == "__main__":
    main()
