"""Each forward kernel's time against the number of heads, as a script: how a kernel's time steps with its
count of programs (waves of programs on the SMs) at a fixed sequence length.

    python measure/heads_scan.py [--shape 4K:64] [--heads 66,72,74,76,80,92,99] [--chunk 256] [--json OUT/heads.json]

gpu_cases.scan_case at each head count (B=1, P=64, G=1, bfloat16 x/B/C, float32 dt, D per head, initial
states), chunk 256, tuning off. PDL is off for the run (M2OPS_PDL=0), so that the profiler's kernel spans do not
overlap and each is that kernel's own time. Call times are host-free (harness.median_ms with HOST_FREE).
"""

from __future__ import annotations

import os

os.environ["M2OPS_PDL"] = "0"

import torch  # noqa: E402

import harness  # noqa: E402 - first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case  # noqa: E402


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "4K:64", one=True)
    ap.add_argument("--heads", type=harness.sizes, default="66,72,74,76,80,92,99")
    harness.add_chunk(ap)
    harness.add_json(ap)
    args = ap.parse_args()
    T, N = args.shape.seqlen, args.shape.dstate
    rows = []
    for h in args.heads:
        case = scan_case(T, N, args.chunk, nheads=h)

        def call():
            with torch.no_grad():
                return public_call(case, return_final_states=True)

        call()
        torch.cuda.synchronize()
        row = {"heads": h, "seqlen": T, "dstate": N, "call_ms": harness.median_ms(call, **harness.HOST_FREE),
               "kernels_ms": harness.kernel_times(call, reps=20)}
        rows.append(row)
        ks = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(row["kernels_ms"].items()))
        print(f"H={h:4d}  call {row['call_ms'] * 1e3:.1f} us   {ks}", flush=True)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
