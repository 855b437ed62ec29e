"""Smoke check of the cuTile kernels against the reference, as a script (not collected by pytest).

    python tests/gpu/check_kernels.py [--time]   # a spread of shapes, dtypes and options [and timings]
    python tests/gpu/check_kernels.py --small    # a few small cases: tail chunks, ngroups > 1, varlen,
                                                 # seq_idx, D, z (sized for compute-sanitizer)
    python tests/gpu/check_kernels.py --profile  # op, kernel and public-call times at T=16K N=128 and
                                                 # T=64K N=256, chunk 64/128/256, with the knob sweeps
    python tests/gpu/check_kernels.py --compare  # --small, then --profile; SUMMARY last

Prints one line per case and output (normwise relative error, bound) and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import TOL, make_case, poison_allocator, public_call, reference_forward, rel_err  # noqa: E402

import m2ops  # noqa: E402
from m2ops import kernels  # noqa: E402

FAILED = []


def report(name, what, err, tol):
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name:<58} {what:<14} {err:.2e} (<= {tol:.0e})", flush=True)
    if not ok:
        FAILED.append(f"{name} {what}")


def check_case(name, **kw):
    try:
        t0 = time.time()
        case = make_case(**kw)
        dtype = case["x"].dtype
        ret_varlen = case["cu_seqlens"] is not None
        y_ref, fin_ref, var_ref, mid = reference_forward(case, return_varlen=ret_varlen)
        dt_min, dt_max = case["dt_limit"]

        poison_allocator()
        dt_out, cs = kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], case["chunk_size"],
                                          case["dt_softplus"], float(dt_min), float(dt_max))
        report(name, "dt_out", rel_err(dt_out, mid["dt_out"]), TOL["cumsum"][dtype])
        report(name, "dA_cumsum", rel_err(cs, mid["dA_cumsum"]), TOL["cumsum"][dtype])

        poison_allocator()
        st, fin, var = kernels.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                              case["initial_states"], case["seq_idx"],
                                              case["cu_seqlens"] if ret_varlen else None)
        report(name, "states", rel_err(st, mid["states"]), TOL["states"][dtype])
        report(name, "final", rel_err(fin, fin_ref), TOL["states"][dtype])
        if ret_varlen:
            report(name, "varlen", rel_err(var, var_ref), TOL["states"][dtype])

        poison_allocator()
        y = kernels.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                                case["D"], case["z"], case["seq_idx"])
        assert y.dtype == dtype and y.shape == case["x"].shape
        report(name, "y (op)", rel_err(y, y_ref), TOL["y"][dtype])

        poison_allocator()
        from m2ops.kernels import launch
        launch.SEGMENTS_OVERRIDE = True  # the fused segment kernels wherever they can run (dstate <= 128, chunk >= 64)
        try:
            y, fin = kernels.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                        case["initial_states"], case["D"], case["z"], case["seq_idx"])
        finally:
            launch.SEGMENTS_OVERRIDE = None
        assert y.dtype == dtype and y.shape == case["x"].shape
        report(name, "y (scan)", rel_err(y, y_ref), TOL["y"][dtype])
        report(name, "final (scan)", rel_err(fin, fin_ref), TOL["states"][dtype])

        poison_allocator()
        out = public_call(case, return_final_states=True, return_varlen_states=ret_varlen)
        report(name, "y (public)", rel_err(out[0], y_ref), TOL["y"][dtype])
        report(name, "final (public)", rel_err(out[1], fin_ref), TOL["states"][dtype])
        torch.cuda.synchronize()
        print(f"     {name}: {time.time() - t0:.1f}s (compiles included)", flush=True)
    except Exception:  # noqa: BLE001 - report and go on to the next case
        FAILED.append(f"{name} raised")
        print(f"FAIL {name} raised:\n{traceback.format_exc()}", flush=True)


def small_cases():
    check_case("bf16 L64 T100 G2 tail seq z D", dtype=torch.bfloat16, chunk_size=64, seqlen=100, batch=2,
               nheads=4, ngroups=2, headdim=16, dstate=16, D="h", z=True, initial_states=True, seq_idx=True)
    check_case("fp16 L16 T37 varlen G2 Dhp", dtype=torch.float16, chunk_size=16, seqlen=37, nheads=4,
               ngroups=2, headdim=8, dstate=24, D="hp", cu_seqlens=True, nseqs=5, initial_states=True)
    check_case("fp32 L256 T300 seq init", dtype=torch.float32, chunk_size=256, seqlen=300, batch=2,
               nheads=2, headdim=32, dstate=32, seq_idx=True, initial_states=True, D="h", z=True)
    # Tile-aligned shapes: chunk_state and compute_out take their unchecked loads (launch.tiles_in_bounds).
    check_case("bf16 L256 T1024 aligned seq z D init", dtype=torch.bfloat16, chunk_size=256, seqlen=1024,
               batch=2, nheads=4, ngroups=2, headdim=64, dstate=128, seq_idx=True, z=True, D="h",
               initial_states=True)
    check_case("fp16 L64 T512 aligned N64 Dhp", dtype=torch.float16, chunk_size=64, seqlen=512, nheads=3,
               headdim=128, dstate=64, D="hp", initial_states=True)


def full_cases():
    small_cases()
    check_case("bf16 L128 T513 G4 varlen z Dhp", dtype=torch.bfloat16, chunk_size=128, seqlen=513, nheads=8,
               ngroups=4, headdim=64, dstate=128, z=True, D="hp", cu_seqlens=True, nseqs=7)
    check_case("bf16 L32 T1000 P128 N256 noncontig", dtype=torch.bfloat16, chunk_size=32, seqlen=1000,
               batch=2, nheads=4, ngroups=1, headdim=128, dstate=256, noncontig=True, D="h")
    check_case("fp16 L256 T769 P80 N100 seq", dtype=torch.float16, chunk_size=256, seqlen=769, nheads=3,
               ngroups=3, headdim=80, dstate=100, seq_idx=True, nseqs=6, z=True)
    check_case("bf16 x, fp32 dt, limit, no softplus", dtype=torch.bfloat16, dt_dtype=torch.float32,
               chunk_size=64, seqlen=200, nheads=4, headdim=64, dstate=64, dt_softplus=False,
               dt_limit=(0.01, 0.15), dt_bias=False)
    check_case("fp32 L32 N512 P64 init", dtype=torch.float32, chunk_size=32, seqlen=130, nheads=2,
               headdim=64, dstate=512, initial_states=True)
    check_case("bf16 L128 T1 single token", dtype=torch.bfloat16, chunk_size=128, seqlen=1, nheads=2,
               headdim=64, dstate=64, initial_states=True, D="h")
    # Paths that run the reference: float64 and an unsupported chunk size.
    for name, kw in (("fp64 fallback", dict(dtype=torch.float64)), ("chunk 48 fallback", dict(chunk_size=48))):
        try:
            case = make_case(seqlen=70, **kw)
            y_ref, fin_ref, _, _ = reference_forward(case)
            out = public_call(case)
            report(name, "y (public)", rel_err(out[0], y_ref), 1e-6)
        except Exception:  # noqa: BLE001
            FAILED.append(f"{name} raised")
            print(f"FAIL {name} raised:\n{traceback.format_exc()}", flush=True)


def timings():
    """Forward time of the public function at a few protocol shapes (B=1, H=80, P=64, G=1, bf16)."""
    for T, N, L in ((16384, 128, 64), (16384, 128, 256), (65536, 128, 256)):
        case = make_case(seqlen=T, nheads=80, headdim=64, ngroups=1, dstate=N, chunk_size=L,
                         dtype=torch.bfloat16, D="h", initial_states=True, z=False)
        case["dt"] = case["dt"].float()
        fn = lambda: public_call(case, return_final_states=True)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        print(f"time T={T} N={N} L={L}: median {times[len(times) // 2]:.3f} ms", flush=True)


def _median_ms(fn, reps=20):
    from m2ops.kernels.launch import median_ms
    return median_ms(fn, reps)


# Kernel names as they appear in the profiler (substrings of the cuTile symbols).
KERNEL_NAMES = ("chunk_cumsum", "chunk_state", "state_passing", "varlen_states", "chunk_cb", "compute_out",
                "compute_out_carry")


def _forward_bucket(symbol: str) -> str:
    """The forward kernel whose name a profiler symbol contains, else "other"."""
    return next((k for k in KERNEL_NAMES if k + "_kernel" in symbol), "other")


def _kernel_times(fn, reps=10, bucket=_forward_bucket):
    """Device time per call of fn's kernels over reps calls, from the torch profiler, summed by bucket(symbol)
    (default: the forward kernels by name and "other"); {} when the profiler cannot record CUDA kernels."""
    try:
        from torch.profiler import ProfilerActivity, profile as tprofile
        fn()
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = getattr(ev, "self_cuda_time_total", 0.0)
            if not us:
                continue
            name = bucket(ev.key)
            out[name] = out.get(name, 0.0) + us / 1000.0 / reps
        return out
    except Exception as e:  # noqa: BLE001 - per-kernel times are a bonus; op times are measured anyway
        print(f"     (no per-kernel times: {type(e).__name__}: {e})", flush=True)
        return {}


PROFILE_SHAPES = ((16384, 128), (65536, 256))
PROFILE_CHUNKS = (64, 128, 256)


def profile():
    """At T=16K N=128 and T=64K N=256 (B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial states,
    final states), chunk 64, 128 and 256: each op's and each kernel's time and the public call's time; then,
    at each shape and chunk size, the state_passing block sizes and each occupancy hint against none (or
    occupancy 3 where the default has no hint), timed on the op that launches the kernel."""
    from m2ops.kernels import launch
    from m2ops.kernels.common import STATE_BLOCKS
    rows = []
    for T, N in PROFILE_SHAPES:
        case = make_case(seqlen=T, nheads=80, headdim=64, ngroups=1, dstate=N, dtype=torch.bfloat16, D="h",
                         initial_states=True)
        case["dt"] = case["dt"].float()
        x, B, C, D, init = case["x"], case["B"], case["C"], case["D"], case["initial_states"]
        for L in PROFILE_CHUNKS:
            t0 = time.time()
            case["chunk_size"] = L
            cumsum = lambda: kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], L, True, 0.0,  # noqa: E731
                                                  float("inf"))
            dt_out, cs = cumsum()
            fwd = lambda: kernels.fwd_pass_state(x, B, dt_out, cs, init, None, None)  # noqa: E731
            st_, fin, _ = fwd()
            out = lambda: kernels.compute_out(x, dt_out, cs, C, B, st_, D, None, None)  # noqa: E731
            pub = lambda: public_call(case, return_final_states=True)  # noqa: E731
            r = dict(T=T, N=N, L=L, cumsum=_median_ms(cumsum), fwd=_median_ms(fwd), out=_median_ms(out),
                     public=_median_ms(pub))
            r["kernels"] = _kernel_times(pub)
            blk = launch.forward_state_block()
            print(f"profile T={T} N={N} L={L}: chunk_cumsum {r['cumsum']:.3f}  fwd_pass_state {r['fwd']:.3f}  "
                  f"compute_out {r['out']:.3f}  public {r['public']:.3f} ms  (state block {blk}; "
                  f"{time.time() - t0:.0f}s with compiles)", flush=True)
            if r["kernels"]:
                print("     kernels (ms/call): " + "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items()),
                      flush=True)
            # Knobs: state_passing block size; the occupancy hints on and off.
            for b_ in STATE_BLOCKS:
                launch.STATE_BLOCK_OVERRIDE = b_
                try:
                    r[f"fwd blk={b_}"] = _median_ms(fwd)
                finally:
                    launch.STATE_BLOCK_OVERRIDE = None
            for name, fn in (("chunk_state", fwd), ("compute_out", out)):
                # The default against the other of (no hints, occupancy 3): one extra compile per kernel.
                default = launch.kernel_hints(name, "bfloat16", L)
                for hints in ([{}] if default else [{"occupancy": 3}]):
                    launch.HINT_OVERRIDE[name] = hints
                    try:
                        r[f"{name} {hints or 'no hints'}"] = _median_ms(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"     {name} {hints}: {type(e).__name__}: {e}", flush=True)
                    finally:
                        launch.HINT_OVERRIDE.pop(name, None)
            knobs = {k: v for k, v in r.items() if k.startswith(("fwd blk", "chunk_state ", "compute_out "))}
            print("     knobs (op ms; fwd = chunk_state + state_passing, compute_out = chunk_cb + compute_out; "
                  f"defaults: {launch.kernel_hints('chunk_state', 'bfloat16', L) or 'no hints'} / "
                  f"{launch.kernel_hints('compute_out', 'bfloat16', L) or 'no hints'}): "
                  + "  ".join(f"{k} {v:.3f}" for k, v in knobs.items()), flush=True)
            rows.append(r)
            del dt_out, cs, st_, fin
            torch.cuda.empty_cache()
        del case, x, B, C, D, init
        torch.cuda.empty_cache()
    print("\nPROFILE SUMMARY (ms; B=1 H=80 P=64 G=1 bf16, D, initial + final states)")
    print(f"{'T':>6} {'N':>4} {'L':>4} {'public':>8} {'cumsum':>8} {'fwd':>8} {'out':>8}   kernels")
    for r in rows:
        ks = " ".join(f"{k}={v:.3f}" for k, v in r["kernels"].items())
        print(f"{r['T']:>6} {r['N']:>4} {r['L']:>4} {r['public']:>8.3f} {r['cumsum']:>8.3f} {r['fwd']:>8.3f} "
              f"{r['out']:>8.3f}   {ks}")
    for T, N in PROFILE_SHAPES:
        best = min((r for r in rows if r["T"] == T and r["N"] == N), key=lambda r: r["public"])
        print(f"best chunk at T={T} N={N}: L={best['L']} ({best['public']:.3f} ms)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "m2ops", m2ops.__version__,
          "unavailable_reason:", kernels.unavailable_reason(0), flush=True)
    if args.profile:
        profile()
        return
    small_cases() if (args.small or args.compare) else full_cases()
    if args.compare:
        try:
            profile()
        except Exception:  # noqa: BLE001
            FAILED.append("profile raised")
            print(f"profile failed:\n{traceback.format_exc()}", flush=True)
    if args.time:
        try:
            timings()
        except Exception:  # noqa: BLE001
            print(f"timing failed:\n{traceback.format_exc()}", flush=True)
    print(f"SUMMARY: {len(FAILED)} failed" + ("" if not FAILED else ": " + "; ".join(FAILED)), flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
