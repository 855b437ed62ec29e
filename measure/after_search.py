"""The eager call's host time right after a tuning search against a process that found the result stored (an
experiment): bench rows whose tuning search ran in the same worker come out slower than their graph replays.

    M2OPS_TUNING_CACHE=/tmp/t.json python measure/after_search.py --shape 4K:64 [--label fresh]
"""

from __future__ import annotations

import gc
import os
import time

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops.kernels import planned


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "4K:64", one=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    os.environ["M2OPS_AUTOTUNE"] = "1"  # after gpu_cases, which turns tuning off for the other scripts
    case = scan_case(args.shape.seqlen, args.shape.dstate, 256)
    plans = [0]
    real = planned.forward_plan

    def counted(*a, **k):
        plans[0] += 1
        return real(*a, **k)

    planned.forward_plan = counted
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
        ms = harness.median_ms(fn)
        # CPU seconds of the whole process per wall second while timing: above 1, other threads of the process
        # (a compiler, a background worker) were running beside the calls.
        cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
        us = harness.host_us(fn, 50, per_call_s=500e-6)
        print(f"[{args.label}] {step}: eager {ms:.3f} ms, host {us:.1f} us/call, new plans {plans[0] - p0}, "
              f"CALL_PLANS {len(planned.CALL_PLANS)}, threads {len(os.listdir('/proc/self/task'))}, "
              f"process CPU per wall s {cpu:.2f}", flush=True)
    gc.enable()


if __name__ == "__main__":
    main()
