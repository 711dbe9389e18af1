"""The sensitivity sweep serial (this process) and on Ray (a local Ray on 127.0.0.1, N workers): wall time,
tasks per second, peak memory per worker, whether the results are identical, and what N workers would take.

    python bench/sweep_ray.py [--model demo] [--tokens 1024] [--precisions int8,int4] [--workers 2]
                              [--threads 2]

Measured KL trials (``--score kl``). The serial run uses ``--threads`` torch threads; each Ray worker one.
The projection to 8 and 32 workers divides the measured per-task time by the worker count (tasks are
independent) and adds each worker's measured start-up; it is arithmetic, not a measurement.
"""
from __future__ import annotations

import argparse
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--precisions", default="int8,int4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the serial run")
    args = ap.parse_args()
    import torch

    from workbench.models import load_model
    from workbench.sensitivity import run_sensitivity
    from workbench.sweep_backends import RayBackend
    from workbench.units import format_bytes

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    precisions = tuple(args.precisions.split(","))
    kw = dict(tokens=args.tokens, precisions=precisions, score="kl", progress=False)
    t0 = time.perf_counter()
    serial = run_sensitivity(lm, **kw)
    t_serial = time.perf_counter() - t0
    peak_serial = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the whole process, model included
    n = serial.trials_run
    backend = RayBackend("auto", workers=args.workers)
    t0 = time.perf_counter()
    spread = run_sensitivity(lm, **kw, backend=backend)
    t_ray = time.perf_counter() - t0
    same = [x.damage for x in spread.layers] == [x.damage for x in serial.layers]
    per_task = serial.seconds / n
    startup = max(0.0, t_ray - spread.seconds / args.workers)  # Ray start, payload, each worker's baseline
    print(f"{lm.name}: {n} trials ({len(serial.layers)} layers x {','.join(precisions)}), {args.tokens} tokens")
    print(f"{'run':<22} {'wall s':>8} {'tasks/s':>8} {'peak memory per worker':>24}")
    print(f"{'serial (' + str(args.threads) + ' threads)':<22} {t_serial:>8.2f} {n / t_serial:>8.2f} "
          f"{format_bytes(peak_serial):>24}")
    peaks = ", ".join(format_bytes(p) for p in backend.peaks.values())
    print(f"{'ray, ' + str(args.workers) + ' workers':<22} {t_ray:>8.2f} {n / t_ray:>8.2f} {peaks:>24}")
    print(f"ray / serial wall time: {t_ray / t_serial:.2f}x; results identical: {same}")
    for w in (8, 32):
        print(f"projected on {w} workers: {startup + per_task * n / w:.1f} s "
              f"(measured {per_task:.3f} s per task, {startup:.1f} s start-up)")


if __name__ == "__main__":
    main()
