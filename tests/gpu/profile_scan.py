"""Times of the fused scan (the chunk_scan op behind the public function) on a GPU, as a script.

    python tests/gpu/profile_scan.py [--shapes 16K:128,64K:256] [--chunk 256] [--sweep]

For each shape (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states): the public call's
median time and the time of each of its kernels (torch profiler), then the chunk_scan op at the launcher's
choice, forced through the fused segment kernels (where they can run: dstate <= 128, chunk >= 64) and
through the two-op kernels (fwd_pass_state + compute_out). --sweep also times the fused kernels at several
segments per SM and occupancy hints (each hint is one more compile). Tuning is off (gpu_cases sets
M2OPS_AUTOTUNE=0): the launcher's choice is its default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_kernels import _kernel_times, _median_ms, KERNEL_NAMES  # noqa: E402
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops import kernels  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import launch  # noqa: E402

NAMES = KERNEL_NAMES + ("segment_state", "segment_out")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1K:128,4K:128,16K:64,16K:128,16K:256,16K:512,64K:128,64K:256")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ppsm", default="2,4,8,16", help="segment programs per SM to sweep")
    ap.add_argument("--occ", default="1,2,3,4", help="occupancy hints to sweep")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import check_kernels
    check_kernels.KERNEL_NAMES = NAMES
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        T, N, L = parse_sizes(t_s)[0], int(n_s), args.chunk
        t0 = time.time()
        case = scan_case(T, N, L)
        x, B, C, D, init = case["x"], case["B"], case["C"], case["D"], case["initial_states"]
        pub = lambda: public_call(case, return_final_states=True)  # noqa: E731
        dt_out, cs = kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], L, True, 0.0, float("inf"))
        scan = lambda: kernels.chunk_scan(x, dt_out, cs, B, C, init, D, None, None)  # noqa: E731
        can_fuse = launch.segments_can_run(L, N)

        def fused():
            """chunk_scan through the segment kernels whatever the launcher would choose."""
            launch.SEGMENTS_OVERRIDE = True
            try:
                return scan()
            finally:
                launch.SEGMENTS_OVERRIDE = None

        def two_ops():
            st_, fin, _ = kernels.fwd_pass_state(x, B, dt_out, cs, init, None, None)
            return kernels.compute_out(x, dt_out, cs, C, B, st_, D, None, None)

        r = dict(T=T, N=N, L=L, public=_median_ms(pub), scan=_median_ms(scan),
                 fused=_median_ms(fused) if can_fuse else None, two_ops=_median_ms(two_ops))
        r["kernels"] = _kernel_times(pub)
        nb = -(-T // launch.segment_constants(N, False)["BL"])
        r["segments"] = launch.segment_count(1, 80, -(-64 // launch.segment_constants(N, False)["TP"]), nb,
                                             x.device)
        fused_ms = f"{r['fused']:.3f}" if can_fuse else "n/a"
        print(f"T={T} N={N} L={L}: public {r['public']:.3f}  chunk_scan {r['scan']:.3f}  fused {fused_ms}  "
              f"two ops {r['two_ops']:.3f} ms  segments {r['segments']}  ({time.time() - t0:.0f}s)", flush=True)
        print("     kernels (ms/call): " + "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items()), flush=True)
        if args.sweep and can_fuse:
            base = launch.SEGMENT_PROGRAMS_PER_SM
            for p in (int(v) for v in args.ppsm.split(",")):
                launch.SEGMENT_PROGRAMS_PER_SM = p
                try:
                    r[f"ppsm={p}"] = _median_ms(fused)
                finally:
                    launch.SEGMENT_PROGRAMS_PER_SM = base
            for name in ("segment_state", "segment_out"):
                for occ in (int(v) for v in args.occ.split(",")):
                    launch.HINT_OVERRIDE[name] = {"occupancy": occ}
                    try:
                        r[f"{name} occ={occ}"] = _median_ms(fused)
                    except Exception as e:  # noqa: BLE001
                        print(f"     {name} occ={occ}: {type(e).__name__}: {e}", flush=True)
                    finally:
                        launch.HINT_OVERRIDE.pop(name, None)
            print("     sweep (fused ms): " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()
                                                            if "=" in k), flush=True)
        rows.append(r)
        del case, x, B, C, D, init, dt_out, cs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
