"""Each forward kernel's time against the number of heads, as a script: how a kernel's time steps with its
count of programs (waves of programs on the SMs) at a fixed sequence length.

    python tests/gpu/heads_scan.py [--shape 4K:64] [--heads 66,72,74,76,80,92,99] [--json OUT/heads.json]

gpu_cases.scan_case at each head count (B=1, P=64, G=1, bfloat16 x/B/C, float32 dt, D per head, initial
states), chunk 256, tuning off. PDL is off for the run (M2OPS_PDL=0), so that the profiler's kernel spans do not
overlap and each is that kernel's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["M2OPS_PDL"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from check_kernels import _kernel_times, _median_ms  # noqa: E402
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4K:64")
    ap.add_argument("--heads", default="66,72,74,76,80,92,99")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t_s, n_s = args.shape.split(":")
    T, N = parse_sizes(t_s)[0], int(n_s)
    rows = []
    for h in parse_sizes(args.heads):
        case = scan_case(T, N, args.chunk, nheads=h)

        def call():
            with torch.no_grad():
                return public_call(case, return_final_states=True)

        call()
        torch.cuda.synchronize()
        row = {"heads": h, "seqlen": T, "dstate": N, "call_ms": _median_ms(call),
               "kernels_ms": _kernel_times(call, reps=20)}
        rows.append(row)
        ks = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(row["kernels_ms"].items()))
        print(f"H={h:4d}  call {row['call_ms'] * 1e3:.1f} us   {ks}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
