"""Where the backward's time goes, on a GPU, as a script:

    python measure/backward_scan.py [--shapes 16K:128,64K:128] [--chunk 256] [--rows 14] [--json OUT]
                                    [--occupancy 2,3,4] [--variants a,b,...]

For each shape (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, A, D, initial states, final states): the median
time of the public call's forward alone and of forward + backward (gradients of x, dt, A, B, C, D and the
initial state, as `python -m m2ops.bench --backward` times them), then the device time per call of each
kernel the pair launches, cuTile kernels by name and PyTorch's own kernels (the element-wise glue around
them) by symbol, largest first (torch profiler). Tuning is off (gpu_cases sets M2OPS_AUTOTUNE=0).

--occupancy k1,k2,...: the same again with each backward kernel that takes hints (backward.HINTED) compiled
with ct.kernel occupancy k (harness.hints), each variant's gradients compared with the first run's,
so that one run gives each kernel's time at each occupancy.

--variants a,b,...: the same again with each variant of VARIANTS (a config knob of the backward set one way, or
one kernel's occupancy hint), gradients compared likewise.
"""

from __future__ import annotations

import sys

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import forward_and_backward, rel_err, scan_case

from m2ops.bench.kernels import short_name
from m2ops.kernels import backward, config

# Variants of the backward: ("config", knobs of m2ops.kernels.config set for the variant) or ("hints", kernel ->
# ct.kernel hints, through harness.hints). The default run has every knob at config.current()'s value.
VARIANTS = {
    # gcarry apart from state_passing_bwd's walk (state_carry_grad_kernel), or in it, whatever the rule says
    "separate carry": ("config", {"separate_carry_grad": True}),
    "carry in walk": ("config", {"separate_carry_grad": False}),
}
# Occupancy hints of the kernels whose hint one sweep chose (specialise._OCCUPANCY_ANY_CHUNK; without one tileiras
# 13.4's sm_90 builds take 255 registers per thread at 256 threads: one CTA per SM): "<kernel> occ <k>" sets
# that kernel's hint alone (harness.hints), "<kernel> no occ" removes it, "swept occ <k>" and "swept no
# occ" do so for all of them.
SWEPT = ("state_passing_bwd", "state_carry_grad", "chunk_cumsum_bwd", "chunk_cb")
for _occ in (2, 4, 8):
    for _name in SWEPT:
        VARIANTS[f"{_name} occ {_occ}"] = ("hints", {_name: {"occupancy": _occ}})
    VARIANTS[f"swept occ {_occ}"] = ("hints", {_name: {"occupancy": _occ} for _name in SWEPT})
for _name in SWEPT:
    VARIANTS[f"{_name} no occ"] = ("hints", {_name: {}})
VARIANTS["swept no occ"] = ("hints", {_name: {} for _name in SWEPT})


def variant(v):
    """The context of one run: None the defaults, an int that occupancy for every kernel of backward.HINTED, a
    name of VARIANTS its knobs or hints."""
    if v is None:
        return harness.hints({})
    if isinstance(v, int):
        return harness.hints({name: {"occupancy": v} for name in backward.HINTED})
    kind, what = VARIANTS[v]
    return harness.hints(what) if kind == "hints" else config.override(**what)


def device_times(fn, reps=5) -> dict:
    """Device ms per call of every kernel fn launches, cuTile kernels by name, largest first."""
    times = harness.kernel_times(fn, reps, bucket=short_name)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128,64K:128")
    harness.add_chunk(ap)
    ap.add_argument("--rows", type=int, default=14, help="kernels printed per run, largest first")
    harness.add_json(ap)
    ap.add_argument("--occupancy", type=harness.sizes, default="",
                    help="e.g. 2,3,4: also time the backward kernels at these")
    ap.add_argument("--variants", type=harness.names, default="", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = [None] + args.occupancy + args.variants
    unknown = [v for v in variants if isinstance(v, str) and v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    for T, N, _ in args.shapes:
        forward, both = forward_and_backward(scan_case(T, N, args.chunk))
        first = None
        for occ in variants:
            with variant(occ):
                try:
                    grads = both()
                except Exception as e:  # noqa: BLE001 - a hint that fails to compile is a result too
                    print(f"T={T} N={N} occupancy {occ}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                if first is None:
                    first = grads
                err = max(rel_err(a, b) for a, b in zip(grads, first))
                r = dict(T=T, N=N, L=args.chunk, occupancy=occ,
                         fwd_ms=harness.median_ms(forward, **harness.HOST_FREE),
                         fwd_bwd_ms=harness.median_ms(both, **harness.HOST_FREE),
                         max_rel_diff_to_first=err, kernels=device_times(both))
            rows.append(r)
            print(f"T={T} N={N} L={args.chunk} occupancy {occ or 'default'}: forward {r['fwd_ms']:.3f} ms, "
                  f"forward+backward {r['fwd_bwd_ms']:.3f} ms (gradients differ from the first run's by {err:.1e}); "
                  f"device time per call by kernel (ms):", flush=True)
            for name, ms in list(r["kernels"].items())[:args.rows]:
                print(f"    {ms:8.3f}  {name}", flush=True)
            print(f"    {sum(r['kernels'].values()):8.3f}  (all kernels)", flush=True)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
