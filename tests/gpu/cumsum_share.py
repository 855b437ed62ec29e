"""What the chunk_cumsum launch costs a forward, as a script (the bound on folding it into another kernel):

    python tests/gpu/cumsum_share.py [--shapes 16K:128,64K:64,4K:64,1K:256,1K:512]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D and initial states, chunk 256), three
CUDA graphs are captured and their replays timed by the benchmark's protocol (m2ops.bench.timing.median_ms: L2
flushed before each run, median of 100), twice each: the public call; launch.chunk_scan alone, on dt_out and
dA_cumsum computed once beforehand; and launch.chunk_cumsum alone. Tuning is off (gpu_cases sets
M2OPS_AUTOTUNE=0).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops.bench.peers import _graphed  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.bench.timing import median_ms  # noqa: E402
from m2ops.kernels import launch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16K:128,64K:64,4K:64,1K:256,1K:512")
    args = ap.parse_args()
    L = 256
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), L)
        cumsum_args = (case["dt"], case["A"], case["dt_bias"], L, True, 0.0, float("inf"))
        dt_out, cs = launch.chunk_cumsum(*cumsum_args)
        graphs = {
            "public call": _graphed(lambda: public_call(case)),
            "chunk_scan alone": _graphed(lambda: launch.chunk_scan(case["x"], dt_out, cs, case["B"], case["C"],
                                                                   case["initial_states"], case["D"], None, None)),
            "chunk_cumsum alone": _graphed(lambda: launch.chunk_cumsum(*cumsum_args)),
        }
        ms = {name: [round(median_ms(g, device="cuda"), 4) for _ in range(2)] for name, g in graphs.items()}
        print(spec, ms, flush=True)


if __name__ == "__main__":
    main()
