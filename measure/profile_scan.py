"""Times of the fused scan (the chunk_scan op behind the public function) on a GPU, as a script.

    python measure/profile_scan.py [--shapes 16K:128,64K:256] [--chunk 256] [--sweep [--ppsm 2,4] [--occ 1,2]]
                                   [--json OUT]

For each shape (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states): the public call's
median time (host-free: harness.median_ms with HOST_FREE) and the time of each of its kernels (torch profiler),
then the chunk_scan op at the launcher's choice, forced through the fused segment kernels (where they can run:
dstate <= 128, chunk >= 64) and through the two-op kernels (fwd_pass_state + compute_out). --sweep also times
the fused kernels at several segments per SM (common.SEGMENT_PROGRAMS_PER_SM, through harness.constants) and
occupancy hints (harness.hints; each hint is one more compile). Tuning is off
(gpu_cases sets M2OPS_AUTOTUNE=0): the launcher's choice is its default.
"""

from __future__ import annotations

import time

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops import kernels
from m2ops.kernels import config, scan, specialise

# The forward kernels and the fused segment kernels, by name.
BUCKET = harness.kernel_bucket(harness.KERNEL_NAMES + ("segment_state", "segment_out"))


def _median_ms(fn):
    return harness.median_ms(fn, **harness.HOST_FREE)


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:128,4K:128,16K:64,16K:128,16K:256,16K:512,64K:128,64K:256")
    harness.add_chunk(ap)
    ap.add_argument("--sweep", action="store_true", help="also the fused kernels' segments per SM and hints")
    ap.add_argument("--ppsm", type=harness.sizes, default="2,4,8,16", help="segment programs per SM to sweep")
    ap.add_argument("--occ", type=harness.sizes, default="1,2,3,4", help="occupancy hints to sweep")
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for T, N, _ in args.shapes:
        L = args.chunk
        t0 = time.time()
        case = scan_case(T, N, L)
        x, B, C, D, init = case["x"], case["B"], case["C"], case["D"], case["initial_states"]
        pub = lambda: public_call(case, return_final_states=True)  # noqa: E731
        dt_out, cs = kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], L, True, 0.0, float("inf"))
        chunk_scan = lambda: kernels.chunk_scan(x, dt_out, cs, B, C, init, D, None, None)  # noqa: E731
        can_fuse = scan.segments_can_run(L, N)

        def fused():
            """chunk_scan through the segment kernels whatever the launcher would choose."""
            with config.override(segments=True):
                return chunk_scan()

        def two_ops():
            st_, fin, _ = kernels.fwd_pass_state(x, B, dt_out, cs, init, None, None)
            return kernels.compute_out(x, dt_out, cs, C, B, st_, D, None, None)

        r = dict(T=T, N=N, L=L, public=_median_ms(pub), scan=_median_ms(chunk_scan),
                 fused=_median_ms(fused) if can_fuse else None, two_ops=_median_ms(two_ops))
        r["kernels"] = harness.kernel_times(pub, bucket=BUCKET)
        nb = -(-T // specialise.segment_constants(N, False)["BL"])
        r["segments"] = scan.segment_count(1, 80, -(-64 // specialise.segment_constants(N, False)["TP"]), nb,
                                             x.device)
        fused_ms = f"{r['fused']:.3f}" if can_fuse else "n/a"
        print(f"T={T} N={N} L={L}: public {r['public']:.3f}  chunk_scan {r['scan']:.3f}  fused {fused_ms}  "
              f"two ops {r['two_ops']:.3f} ms  segments {r['segments']}  ({time.time() - t0:.0f}s)", flush=True)
        print("     kernels (ms/call): " + "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items()), flush=True)
        if args.sweep and can_fuse:
            for p in args.ppsm:
                with harness.constants(SEGMENT_PROGRAMS_PER_SM=p):
                    r[f"ppsm={p}"] = _median_ms(fused)
            for name in ("segment_state", "segment_out"):
                for occ in args.occ:
                    try:
                        with harness.hints({name: {"occupancy": occ}}):
                            r[f"{name} occ={occ}"] = _median_ms(fused)
                    except Exception as e:  # noqa: BLE001
                        print(f"     {name} occ={occ}: {type(e).__name__}: {e}", flush=True)
            print("     sweep (fused ms): " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()
                                                            if "=" in k), flush=True)
        rows.append(r)
        # (rebound, not deleted: the functions above close over them)
        case = x = B = C = D = init = dt_out = cs = None
        torch.cuda.empty_cache()
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
