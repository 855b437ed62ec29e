"""The public call replayed from a CUDA graph, with and without programmatic dependent launch, as a script:

    python tests/gpu/graph_scan.py [--shapes 1K:64,1K:128,1K:256,1K:512] [--chunk 256] [--json OUT]
                                   [--variants defaults,...]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states) and each
setting of launch.PDL, the call is captured in its own graph and its replay timed by the benchmark's protocol
(m2ops.bench.timing.median_ms: L2 flushed before each run, median of 100); the outputs of the two settings
must agree to the bit. Tuning is off (gpu_cases sets M2OPS_AUTOTUNE=0): the launcher's defaults, or with
--variants the kernel variants of tests/gpu/variants_scan.py (VARIANTS), one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
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
from variants_scan import variant  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1K:64,1K:128,1K:256,1K:512")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated names from variants_scan.VARIANTS")
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), args.chunk)
        for name in (args.variants.split(",") if args.variants else [None]):
            with variant(name) if name else contextlib.nullcontext():
                rows.append(_replays(case, n_s, args.chunk, name))
    launch.PDL = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _replays(case, n_s, chunk, name):
    """The case's graph replay with and without PDL, twice each."""
    outs = {}
    row = dict(T=case["x"].shape[1], N=int(n_s), L=chunk, variant=name)
    for pdl in (False, True, False, True):  # twice each, interleaved, to see the spread
        launch.PDL = pdl
        result = []
        try:
            replay = _graphed(lambda: result.append(public_call(case)))
            replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the other setting still runs
            row[f"pdl{int(pdl)}_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"PDL={pdl}: {row[f'pdl{int(pdl)}_error']}", flush=True)
            continue
        outs[pdl] = tuple(t.clone() for t in result[-1])
        row.setdefault(f"pdl{int(pdl)}_ms", []).append(median_ms(replay, device="cuda"))
    same = len(outs) == 2 and all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    row["same_bits"] = same
    print(f"T={row['T']} N={row['N']} {name or ''}: graph replay ms without PDL {row.get('pdl0_ms')}, with PDL "
          f"{row.get('pdl1_ms')}; "
          f"same bits: {same}", flush=True)
    launch.PDL = True
    return row


if __name__ == "__main__":
    main()
