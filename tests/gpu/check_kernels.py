"""Smoke check of the cuTile kernels against the reference, as a script (not collected by pytest).

    python tests/gpu/check_kernels.py            # a spread of shapes, dtypes and options
    python tests/gpu/check_kernels.py --small    # a few small cases: tail chunks, ngroups > 1, varlen,
                                                 # seq_idx, D, z (sized for compute-sanitizer)

Prints one line per case and output (normwise relative error, bound) and exits 1 if any check fails. The op,
kernel and public-call times it printed with --profile and --time are measure/op_times.py's now.
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
        from m2ops.kernels import config
        # the fused segment kernels wherever they can run (dstate <= 128, chunk >= 64)
        with config.override(segments=True):
            y, fin = kernels.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                        case["initial_states"], case["D"], case["z"], case["seq_idx"])
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
    # Tile-aligned shapes: chunk_state and compute_out take their unchecked loads (specialise.tiles_in_bounds).
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the small cases only (for compute-sanitizer)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "m2ops", m2ops.__version__,
          "unavailable_reason:", kernels.unavailable_reason(0), flush=True)
    small_cases() if args.small else full_cases()
    print(f"SUMMARY: {len(FAILED)} failed" + ("" if not FAILED else ": " + "; ".join(FAILED)), flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
