"""Each forward op's, each kernel's and the public call's time, with the launcher's knobs, as a script (what
tests/gpu/check_kernels.py --profile and --time measured before the checks and the measurements parted):

    python measure/op_times.py [--shapes 16K:128,64K:256] [--chunks 64,128,256] [--json OUT]
    python measure/op_times.py --time    # the public call alone at T=16K N=128 chunk 64 and 256, T=64K N=128 chunk 256

Default: at each shape (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states: gpu_cases'
scan_case) and chunk size, the time of chunk_cumsum, fwd_pass_state (chunk_state + state_passing), compute_out
(chunk_cb + compute_out) and the public call, host-free (harness.median_ms with HOST_FREE), and each kernel's
(torch profiler); then the state_passing block sizes (config.override(state_block=...)) and, for chunk_state
and compute_out, each occupancy hint against none (or occupancy 3 where the default has no hint; harness.hints),
timed on the op that launches the kernel; a summary table and the best chunk size per shape last. Tuning is off
(gpu_cases sets M2OPS_AUTOTUNE=0).
--time: the public call's forward only, CUDA events around each of 10 calls queued back to back (no L2 flush).
"""

from __future__ import annotations

import time

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops import kernels
from m2ops.kernels import config, specialise
from m2ops.kernels.common import STATE_BLOCKS

TIME_POINTS = ((16384, 128, 64), (16384, 128, 256), (65536, 128, 256))


def _median_ms(fn):
    return harness.median_ms(fn, **harness.HOST_FREE)


def timings():
    """Forward time of the public function at a few protocol shapes (B=1, H=80, P=64, G=1, bf16)."""
    for T, N, L in TIME_POINTS:
        case = scan_case(T, N, L)
        ms = harness.median_ms(lambda: public_call(case, return_final_states=True), runs=10, warmup=1, flush_l2=False)
        print(f"time T={T} N={N} L={L}: median {ms:.3f} ms", flush=True)


def profile(shapes, chunks):
    """The default run (see the module's docstring); returns its rows."""
    rows = []
    for T, N, _ in shapes:
        case = scan_case(T, N, chunks[0])
        x, B, C, D, init = case["x"], case["B"], case["C"], case["D"], case["initial_states"]
        for L in chunks:
            t0 = time.time()
            case["chunk_size"] = L
            cumsum = lambda: kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], L, True, 0.0,  # noqa: E731
                                                  float("inf"))
            dt_out, cs = cumsum()
            fwd = lambda: kernels.fwd_pass_state(x, B, dt_out, cs, init, None, None)  # noqa: E731
            st_ = fwd()[0]
            out = lambda: kernels.compute_out(x, dt_out, cs, C, B, st_, D, None, None)  # noqa: E731
            pub = lambda: public_call(case, return_final_states=True)  # noqa: E731
            r = dict(T=T, N=N, L=L, cumsum=_median_ms(cumsum), fwd=_median_ms(fwd), out=_median_ms(out),
                     public=_median_ms(pub))
            r["kernels"] = harness.kernel_times(pub)
            blk = specialise.forward_state_block()
            print(f"profile T={T} N={N} L={L}: chunk_cumsum {r['cumsum']:.3f}  fwd_pass_state {r['fwd']:.3f}  "
                  f"compute_out {r['out']:.3f}  public {r['public']:.3f} ms  (state block {blk}; "
                  f"{time.time() - t0:.0f}s with compiles)", flush=True)
            if r["kernels"]:
                print("     kernels (ms/call): " + "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items()),
                      flush=True)
            # Knobs: state_passing block size; the occupancy hints on and off.
            for b_ in STATE_BLOCKS:
                with config.override(state_block=b_):
                    r[f"fwd blk={b_}"] = _median_ms(fwd)
            for name, fn in (("chunk_state", fwd), ("compute_out", out)):
                # The default against the other of (no hints, occupancy 3): one extra compile per kernel.
                default = specialise.kernel_hints(name, "bfloat16", L)
                for hints in ([{}] if default else [{"occupancy": 3}]):
                    try:
                        with harness.hints({name: hints}):
                            r[f"{name} {hints or 'no hints'}"] = _median_ms(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"     {name} {hints}: {type(e).__name__}: {e}", flush=True)
            knobs = {k: v for k, v in r.items() if k.startswith(("fwd blk", "chunk_state ", "compute_out "))}
            print("     knobs (op ms; fwd = chunk_state + state_passing, compute_out = chunk_cb + compute_out; "
                  f"defaults: {specialise.kernel_hints('chunk_state', 'bfloat16', L) or 'no hints'} / "
                  f"{specialise.kernel_hints('compute_out', 'bfloat16', L) or 'no hints'}): "
                  + "  ".join(f"{k} {v:.3f}" for k, v in knobs.items()), flush=True)
            rows.append(r)
            # (rebound, not deleted: the lambdas above close over them)
            dt_out = cs = st_ = None
            torch.cuda.empty_cache()
        case = x = B = C = D = init = None
        torch.cuda.empty_cache()
    print("\nPROFILE SUMMARY (ms; B=1 H=80 P=64 G=1 bf16, D, initial + final states)")
    harness.print_table([{**{k: r[k] for k in ("T", "N", "L", "public", "cumsum", "fwd", "out")},
                          "kernels": " ".join(f"{k}={v:.3f}" for k, v in r["kernels"].items())} for r in rows])
    for T, N, _ in shapes:
        best = min((r for r in rows if r["T"] == T and r["N"] == N), key=lambda r: r["public"])
        print(f"best chunk at T={T} N={N}: L={best['L']} ({best['public']:.3f} ms)", flush=True)
    return rows


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128,64K:256")
    ap.add_argument("--chunks", type=harness.sizes, default="64,128,256")
    ap.add_argument("--time", action="store_true", help="only the public call's time at TIME_POINTS")
    harness.add_json(ap)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "unavailable_reason:", kernels.unavailable_reason(0), flush=True)
    if args.time:
        timings()
        return
    harness.write_json(args.json, profile(args.shapes, args.chunks))


if __name__ == "__main__":
    main()
