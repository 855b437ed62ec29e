"""Where the backward's time goes, on a GPU, as a script:

    python tests/gpu/backward_scan.py [--shapes 16K:128,64K:128] [--chunk 256] [--rows 14] [--json OUT]
                                      [--occupancy 2,3,4]

For each shape (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, A, D, initial states, final states): the median
time of the public call's forward alone and of forward + backward (gradients of x, dt, A, B, C, D and the
initial state, as `python -m m2ops.bench --backward` times them), then the device time per call of each
kernel the pair launches, cuTile kernels by name and PyTorch's own kernels (the element-wise glue around
them) by symbol, largest first (torch profiler). Tuning is off (gpu_cases sets M2OPS_AUTOTUNE=0).

--occupancy k1,k2,...: the same again with each backward kernel that takes hints (launch_bwd.HINTED) compiled
with ct.kernel occupancy k (launch.HINT_OVERRIDE), each variant's gradients compared with the first run's,
so that one run gives each kernel's time at each occupancy.

--variants a,b,...: the same again with each variant of VARIANTS (a launch_bwd switch set one way, or one kernel's
occupancy hint), gradients compared likewise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_kernels import _kernel_times, _median_ms  # noqa: E402
from gpu_cases import forward_and_backward, rel_err, scan_case  # noqa: E402

from m2ops.bench.kernels import short_name  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import launch, launch_bwd  # noqa: E402

# Variants of the backward: a launch_bwd switch and its value in the variant (the default run has each switch at
# DEFAULTS' value).
VARIANTS = {
    # gcarry apart from state_passing_bwd's walk (state_carry_grad_kernel), or in it, whatever the rule says
    "separate carry": ("SEPARATE_CARRY_GRAD", True),
    "carry in walk": ("SEPARATE_CARRY_GRAD", False),
    # out_bwd_dcbw loads the next head's G and x tiles while it works on this head's
    "dcbw prefetch": ("DCBW_PREFETCH", True),
}
DEFAULTS = {"SEPARATE_CARRY_GRAD": None, "DCBW_PREFETCH": False}
# Occupancy hints of the kernels whose hint one sweep chose (launch._OCCUPANCY_ANY_CHUNK; without one tileiras
# 13.4's sm_90 builds take 255 registers per thread at 256 threads: one CTA per SM): "<kernel> occ <k>" sets
# that kernel's hint alone (launch.HINT_OVERRIDE), "<kernel> no occ" removes it, "swept occ <k>" and "swept no
# occ" do so for all of them.
SWEPT = ("state_passing_bwd", "state_carry_grad", "chunk_cumsum_bwd", "chunk_cb")
for _occ in (2, 4, 8):
    for _name in SWEPT:
        VARIANTS[f"{_name} occ {_occ}"] = ("HINT", {_name: {"occupancy": _occ}})
    VARIANTS[f"swept occ {_occ}"] = ("HINT", {_name: {"occupancy": _occ} for _name in SWEPT})
for _name in SWEPT:
    VARIANTS[f"{_name} no occ"] = ("HINT", {_name: {}})
VARIANTS["swept no occ"] = ("HINT", {_name: {} for _name in SWEPT})


def device_times(fn, reps=5) -> dict:
    """Device ms per call of every kernel fn launches, cuTile kernels by name, largest first."""
    times = _kernel_times(fn, reps, bucket=short_name)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16K:128,64K:128")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--json", default=None)
    ap.add_argument("--occupancy", default="", help="e.g. 2,3,4: also time the backward kernels at these")
    ap.add_argument("--variants", default="", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = ([None] + [int(k) for k in args.occupancy.split(",") if k]
                + [v for v in args.variants.split(",") if v])
    unknown = [v for v in variants if isinstance(v, str) and v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        T, N = parse_sizes(t_s)[0], int(n_s)
        forward, both = forward_and_backward(scan_case(T, N, args.chunk))
        first = None
        for occ in variants:
            launch.HINT_OVERRIDE.clear()
            for switch, value in DEFAULTS.items():
                setattr(launch_bwd, switch, value)
            if isinstance(occ, str) and VARIANTS[occ][0] == "HINT":
                launch.HINT_OVERRIDE.update(VARIANTS[occ][1])
            elif isinstance(occ, str):
                setattr(launch_bwd, *VARIANTS[occ])
            if isinstance(occ, int):
                launch.HINT_OVERRIDE.update({name: {"occupancy": occ} for name in launch_bwd.HINTED})
            try:
                grads = both()
            except Exception as e:  # noqa: BLE001 - a hint that fails to compile is a result too
                print(f"T={T} N={N} occupancy {occ}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if first is None:
                first = grads
            err = max(rel_err(a, b) for a, b in zip(grads, first))
            r = dict(T=T, N=N, L=args.chunk, occupancy=occ, fwd_ms=_median_ms(forward), fwd_bwd_ms=_median_ms(both),
                     max_rel_diff_to_first=err, kernels=device_times(both))
            rows.append(r)
            print(f"T={T} N={N} L={args.chunk} occupancy {occ or 'default'}: forward {r['fwd_ms']:.3f} ms, "
                  f"forward+backward {r['fwd_bwd_ms']:.3f} ms (gradients differ from the first run's by {err:.1e}); "
                  f"device time per call by kernel (ms):", flush=True)
            for name, ms in list(r["kernels"].items())[:args.rows]:
                print(f"    {ms:8.3f}  {name}", flush=True)
            print(f"    {sum(r['kernels'].values()):8.3f}  (all kernels)", flush=True)
        launch.HINT_OVERRIDE.clear()
        for switch, value in DEFAULTS.items():
            setattr(launch_bwd, switch, value)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
