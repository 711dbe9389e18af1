"""The measured sensitivity sweep serial, on local worker processes and on a two-node Ray cluster on this
machine: wall time, tasks per second, peak memory per worker, whether the results are identical, and what
8 and 32 workers would take.

    python bench/sweeps.py [--model demo] [--tokens 1024] [--precisions int8,int4] [--workers 2]
                           [--runs serial,processes,ray] [--threads 2]
    python bench/sweeps.py --model ~/.cache/workbench-bench/shapes/qwen2.5-0.5b --tokens 256 --precisions int4

Each run is its own child process (its peak memory is its own; no run warms the next). ``serial`` is the
workbench's default (this process, ``--threads`` torch threads); ``processes`` is ``--workers N`` (forked
workers, one thread each, the model shared copy-on-write); ``ray`` is ``ray.cluster_utils.Cluster`` with two
nodes of N/2 CPUs on this machine, one actor per CPU, each loading the model from Ray's object store.
Peak memory per worker is its peak resident set (shared pages count in full in each); for processes the
private part (what the worker adds) is shown beside it. The projection to 8 and 32 workers is arithmetic
from the measured per-trial time and start-up, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("serial", "processes", "ray")


def one_run(args) -> dict:
    """The sweep on one backend, in this process: what the parent prints a row of."""
    import torch

    from workbench.model.load import load_model
    from workbench.precision.sensitivity import run_sensitivity
    from workbench.model.sweep_backends import ProcessBackend, RayBackend, model_bytes, peak_resident_bytes

    torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    lm = load_model(args.model)
    t_load = time.perf_counter() - t_load
    kw = dict(tokens=args.tokens, precisions=tuple(args.precisions.split(",")), score="kl", progress=False)
    cluster = None
    if args.one == "serial":
        backend = None
    elif args.one == "processes":
        backend = ProcessBackend(args.workers)
    else:
        from workbench.model.sweep_backends import import_ray
        ray = import_ray()
        from ray.cluster_utils import Cluster
        half = max(1, args.workers // 2)
        # each node's object store must hold the model, or every actor unpickles a copy of its own (the test
        # cluster's default store is 150 MB a node; a real node's is 30% of its memory)
        store = int(model_bytes(lm) * 1.2) + (256 << 20)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": half, "include_dashboard": False,
                                                                "object_store_memory": store})
        cluster.add_node(num_cpus=args.workers - half, object_store_memory=store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        backend = RayBackend("joined", workers=args.workers)
    t0 = time.perf_counter()
    report = run_sensitivity(lm, **kw, backend=backend)
    wall = time.perf_counter() - t0
    out = {"run": args.one, "model": str(lm.name), "layers": len(report.layers), "trials": report.trials_run,
           "wall": wall, "load": t_load, "trial_seconds": report.seconds, "damage": [x.damage for x in report.layers],
           "peak": peak_resident_bytes(), "workers": {}, "nodes": 0}
    if args.one == "processes":
        out["workers"] = {str(pid): [backend.peaks[pid], backend.private[pid]] for pid in backend.peaks}
    elif args.one == "ray":
        out["workers"] = {str(i): [p, backend.private.get(i)] for i, p in backend.peaks.items()}
        out["nodes"] = len(set(backend.nodes.values()))
        ray.shutdown()
        cluster.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--precisions", default="int8,int4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the serial run")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # a child: one run, JSON on stdout
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args)))
        return
    from workbench.units import format_bytes
    rows = []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    for run in args.runs.split(","):
        cmd = [sys.executable, __file__, "--one", run, "--model", args.model, "--tokens", str(args.tokens),
               "--precisions", args.precisions, "--workers", str(args.workers), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"{run}: failed\n{done.stderr[-3000:]}")
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if not rows:
        return
    if args.json:
        Path(args.json).write_text(json.dumps(rows), encoding="utf-8")
    first = rows[0]
    n = first["trials"]
    print(f"{first['model']}: {n} trials ({first['layers']} layers x {args.precisions}), {args.tokens:,} tokens, "
          f"{os.cpu_count()} CPUs")
    print(f"{'run':<26} {'wall s':>8} {'tasks/s':>8} {'vs serial':>9}  peak memory per worker (private)")
    serial = next((r for r in rows if r["run"] == "serial"), None)
    for r in rows:
        label = {"serial": f"serial ({args.threads} threads)", "processes": f"{args.workers} local processes",
                 "ray": f"Ray, 2 nodes, {args.workers} workers"}[r["run"]]
        ratio = f"{r['wall'] / serial['wall']:.2f}x" if serial else "-"
        mem = ", ".join(format_bytes(p) + (f" ({format_bytes(q)})" if q else "") for p, q in r["workers"].values()) \
            or f"{format_bytes(r['peak'])} (the whole process)"
        print(f"{label:<26} {r['wall']:>8.1f} {r['trials'] / r['wall']:>8.2f} {ratio:>9}  {mem}")
        if serial and r is not serial:
            same = r["damage"] == serial["damage"]
            print(f"{'':<26} results identical to serial: {same}"
                  + ("" if same else f" (largest relative KL difference {largest_difference(r, serial):.1e}: one-thread "
                                     "workers sum some products in another order than two threads)")
                  + (f"; ran on {r['nodes']} nodes" if r["run"] == "ray" else ""))
    spread = next((r for r in rows if r["run"] == "processes"), None)
    if serial and spread:
        project(args, first, serial, spread)


def largest_difference(a: dict, b: dict) -> float:
    """The largest relative difference between two runs' KL, over every layer and precision (perplexity
    changes are differences of near-equal numbers: relative to themselves they say little)."""
    worst = 0.0
    for x, y in zip(a["damage"], b["damage"]):
        for p in x:
            v, w = x[p]["kl"], y[p]["kl"]
            worst = max(worst, abs(v - w) / max(abs(v), abs(w), 1e-30))
    return worst


# Qwen2.5-14B's published config.json (not in assets/model_shapes.json, which holds the shapes the device
# projection uses): 48 blocks, hidden 5120, MLP 13824, 40 heads over 8 KV heads, 152,064 rows, untied.
QWEN25_14B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
              "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
              "max_position_embeddings": 32768, "tie_word_embeddings": False}


def trial_work(lm, tokens: int, precisions: int) -> float:
    """Parameter-tokens a measured sweep multiplies: each trial runs the blocks from its layer's block on, then
    the output layer, over ``tokens`` tokens (the blocks before it are replayed)."""
    import re
    from collections import defaultdict

    def block(info) -> int | None:  # None: the output layer alone; the embedding changes every block
        m = re.search(r"(\d+)$", str(info.block))
        return int(m.group(1)) if m else (None if info.role == "lm_head" else 0)

    per_block = defaultdict(int)
    head = sum(i.parameters for i in lm.layers if i.role == "lm_head")
    for info in lm.layers:
        if info.role not in ("lm_head", "embed_tokens"):
            per_block[block(info)] += info.parameters
    depth = max(per_block) + 1 if per_block else 0
    after = {b: sum(per_block[c] for c in range(b, depth)) + head for b in range(depth)}
    return float(sum(tokens * (head if block(i) is None else after[block(i)]) for i in lm.layers) * precisions)


def project(args, first: dict, serial: dict, spread: dict) -> None:
    """What the same sweep costs on more workers, and on 7B / 14B shapes: arithmetic from the measured runs."""
    from workbench.model.load import load_model
    from workbench.model.shapes import model_shape
    precisions = len(args.precisions.split(","))
    n, w = spread["trials"], args.workers
    per_task = spread["trial_seconds"] / n  # one one-thread worker's seconds per trial, measured side by side
    setup = max(0.0, serial["wall"] - serial["trial_seconds"])  # the reference and baseline passes
    print(f"\non paper, from the {w}-process run: {per_task:.3f} s per trial on one core, {setup:.1f} s of "
          "reference and baseline passes, each worker a core like these")
    for k in (8, 32):
        print(f"  this sweep on {k} workers: {setup + per_task * n / k:,.1f} s")
    measured = trial_work(load_model(args.model), args.tokens, precisions)
    per_work = per_task * n / measured
    print(f"  cost per parameter-token of a trial: {per_work:.3e} core-s (the output layer and later blocks "
          "included; quantizing the layer itself not scaled separately)")
    for name, source in (("Qwen2.5-7B", "qwen2.5-7b"), ("Qwen2.5-14B", QWEN25_14B)):
        shape = model_shape(source, name)
        work = trial_work(shape, args.tokens, precisions)
        trials = len(shape.layers) * precisions
        cells = ", ".join(f"{k} workers {per_work * work / k / 3600:,.2f} h" for k in (1, 8, 32))
        print(f"  {name} ({trials} trials, {args.tokens:,} tokens): {cells}")


if __name__ == "__main__":
    main()
