"""What the chunk_cumsum launch costs a forward, as a script (the bound on folding it into another kernel):

    python measure/cumsum_share.py [--shapes 16K:128,64K:64,4K:64,1K:256,1K:512] [--json OUT]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D and initial states, chunk 256), three
CUDA graphs are captured and their replays timed by the benchmark's protocol (harness.median_ms: L2 flushed
before each run, median of 100), twice each: the public call; scan.chunk_scan alone, on dt_out and dA_cumsum
computed once beforehand; and forward.chunk_cumsum alone. Tuning is off (gpu_cases sets M2OPS_AUTOTUNE=0).
"""

from __future__ import annotations

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops.kernels import forward, scan


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128,64K:64,4K:64,1K:256,1K:512")
    harness.add_json(ap)
    args = ap.parse_args()
    L = 256
    rows = []
    for T, N, spec in args.shapes:
        case = scan_case(T, N, L)
        cumsum_args = (case["dt"], case["A"], case["dt_bias"], L, True, 0.0, float("inf"))
        dt_out, cs = forward.chunk_cumsum(*cumsum_args)
        graphs = {
            "public call": harness.graphed(lambda: public_call(case)),
            "chunk_scan alone": harness.graphed(lambda: scan.chunk_scan(case["x"], dt_out, cs, case["B"], case["C"],
                                                                          case["initial_states"], case["D"], None,
                                                                          None)),
            "chunk_cumsum alone": harness.graphed(lambda: forward.chunk_cumsum(*cumsum_args)),
        }
        ms = {name: [round(harness.median_ms(g), 4) for _ in range(2)] for name, g in graphs.items()}
        print(spec, ms, flush=True)
        rows.append(dict(T=T, N=N, L=L, ms=ms))
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
