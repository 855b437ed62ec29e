"""The eager call's host time right after a tuning search against a process that found the result stored (an
experiment): bench rows whose tuning search ran in the same worker come out slower than their graph replays.

    M2OPS_TUNING_CACHE=/tmp/t.json python tests/gpu/after_search.py --shape 4K:64 [--label fresh]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402
from launch_cost import host_us  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.bench.timing import median_ms  # noqa: E402
from m2ops.kernels import launch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4K:64")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    os.environ["M2OPS_AUTOTUNE"] = "1"  # after gpu_cases, which turns tuning off for the other scripts
    t_s, n_s = args.shape.split(":")
    case = scan_case(parse_sizes(t_s)[0], int(n_s), 256)
    plans = [0]
    real = launch.forward_plan

    def counted(*a, **k):
        plans[0] += 1
        return real(*a, **k)

    launch.forward_plan = counted
    t0 = time.perf_counter()
    public_call(case)
    torch.cuda.synchronize()
    print(f"[{args.label}] first call {time.perf_counter() - t0:.2f} s, gc objects {len(gc.get_objects())}")
    fn = lambda: public_call(case)  # noqa: E731
    for step in ("as is", "as is", "gc.collect+freeze", "gc disabled"):
        if step == "gc.collect+freeze":
            gc.collect()
            gc.freeze()
        if step == "gc disabled":
            gc.disable()
        p0 = plans[0]
        w0, c0 = time.perf_counter(), time.process_time()
        ms = median_ms(fn, device="cuda")
        # CPU seconds of the whole process per wall second while timing: above 1, other threads of the process
        # (a compiler, a background worker) were running beside the calls.
        cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
        us = host_us(fn, 50, per_call_s=500e-6)
        print(f"[{args.label}] {step}: eager {ms:.3f} ms, host {us:.1f} us/call, new plans {plans[0] - p0}, "
              f"CALL_PLANS {len(launch.CALL_PLANS)}, threads {len(os.listdir('/proc/self/task'))}, "
              f"process CPU per wall s {cpu:.2f}", flush=True)
    gc.enable()


if __name__ == "__main__":
    main()
