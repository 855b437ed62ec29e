"""The chained scan (chained.py) against chunk_scan's two-op path on a GPU, as a script:

    python tests/gpu/chain_scan.py [--shapes 16K:128,64K:64] [--chunk 256] [--occupancy 0,2] [--json OUT/chain.json]

Per shape (profile_scan.py's case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D per head, initial states):
chunk_cumsum once, then chunk_scan through the two-op path (its default configuration) and through the chain at
each occupancy hint (0: none). Reports the median device time of each (launch.median_ms, 50 runs), the chain's y
and final state against the two-op path's and, up to --ref-max tokens, against the float32 reference (relative
error), and whether --repeats (20) repeated chain runs gave the same bits (the chain's programs wait on each other; a race
would show as runs that differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import reference_forward, rel_err, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import launch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16K:128,64K:64")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--occupancy", default="0,2")
    ap.add_argument("--ref-max", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        t_s, n_s = shape.split(":")
        T, N = parse_sizes(t_s)[0], int(n_s)
        case = scan_case(T, N, args.chunk)
        dt_out, cs = launch.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], args.chunk, True, 0.0, float("inf"))
        ins = (case["x"], dt_out, cs, case["B"], case["C"], case["initial_states"], case["D"], case["z"], None)
        split = {"path": "split", "state_block": launch.forward_state_block()}
        y0, f0 = launch._chunk_scan_with(split, *ins)
        row = dict(T=T, N=N, chunk=args.chunk, split_ms=launch.median_ms(lambda: launch._chunk_scan_with(split, *ins),
                                                                          args.reps))
        if T <= args.ref_max:
            y_r, f_r, _, _ = reference_forward(case)
            row["split_err"] = (rel_err(y0, y_r), rel_err(f0, f_r))
        for occ in (int(v) for v in args.occupancy.split(",")):
            launch.HINT_OVERRIDE = {"chained_scan": {"occupancy": occ}} if occ else {"chained_scan": {}}
            try:
                y1, f1 = launch._chunk_scan_with({"path": "chain"}, *ins)
                torch.cuda.synchronize()
                same = all(torch.equal(y1, y) and torch.equal(f1, f) for y, f in
                           (launch._chunk_scan_with({"path": "chain"}, *ins) for _ in range(args.repeats)))
                ms = launch.median_ms(lambda: launch._chunk_scan_with({"path": "chain"}, *ins), args.reps)
                entry = dict(ms=ms, vs_split=(rel_err(y1, y0), rel_err(f1, f0)), repeat_bits_equal=same)
                if T <= args.ref_max:
                    entry["err"] = (rel_err(y1, y_r), rel_err(f1, f_r))
            except Exception as e:  # noqa: BLE001 - recorded, the next variant still runs
                entry = dict(error=f"{type(e).__name__}: {e}"[:300])
            finally:
                launch.HINT_OVERRIDE = {}
            row[f"chain_occ{occ}"] = entry
            print(f"  {T} {N} occupancy {occ}: {entry}", flush=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del case, ins, y0, f0
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
