"""Upper bounds by omission (an experiment, results are wrong by design): the public call's time, replayed from a
CUDA graph and eager, with the launches of named kernels dropped. What a kernel's removal would save is at most
the difference to the defaults.

    python tests/gpu/skip_scan.py [--shapes 1K:256,64K:64] [--skips "-,chunk_cb_kernel,..."] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops.bench.peers import _graphed  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.bench.timing import median_ms  # noqa: E402
from m2ops.kernels import launch  # noqa: E402

_REAL = launch._launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1K:256,1K:512,4K:64,16K:128,64K:64")
    ap.add_argument("--skips", default="-,chunk_cb_kernel,chunk_cumsum_kernel,chunk_cb_kernel+chunk_cumsum_kernel,-")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), args.chunk)
        for skip in args.skips.split(","):
            names = set() if skip == "-" else set(skip.split("+"))

            def patched(grid, kernel, a, pdl=None, arrays=None, slot=None):
                if kernel._pyfunc.__name__ in names:
                    return None
                return _REAL(grid, kernel, a, pdl, arrays, slot)

            launch._launch = patched
            try:
                eager = median_ms(lambda: public_call(case), device="cuda")
                replay = _graphed(lambda: public_call(case))
                graph = median_ms(replay, device="cuda")
            finally:
                launch._launch = _REAL
            row = dict(T=case["x"].shape[1], N=int(n_s), skip=skip, eager_ms=eager, graph_ms=graph)
            print(row, flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
