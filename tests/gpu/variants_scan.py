"""Kernel variants of the two-op forward path side by side on a GPU, as a script (the experiments behind
docs/performance-log.md):

    python tests/gpu/variants_scan.py [--shapes 16K:128,64K:256] [--chunk 256] [--json OUT/variants.json]

Each variant sets launch.CONSTANT_OVERRIDE / launch.HINT_OVERRIDE (compile-time constants and ct.kernel hints
of chunk_state and compute_out) and index_width.NARROW_INDEX (32-bit-indexed kernels), runs the public call, checks y and the final state against the 64-bit-indexed kernels' with float32 C.B^T and states
(relative error), and reports the median call time and each kernel's time (torch profiler). Shapes as
profile_scan.py: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states. Tuning is off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_kernels import _kernel_times, _median_ms  # noqa: E402
from gpu_cases import public_call, rel_err, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import index_width, launch  # noqa: E402

# name -> (CONSTANT_OVERRIDE, HINT_OVERRIDE, 32-bit indexed twins on[, "cb16": launch.CB_IN_BF16,
#          "states16": launch.STATES_IN_BF16, "local16": launch.LOCAL_STATES_IN_BF16])
VARIANTS = {
    "index64": ({}, {}, False),
    "index32": ({}, {}, True),
    "bounds-checked": ({"chunk_state": {"CHK": True}, "compute_out": {"CHK": True}}, {}, False),
    "out occ 3": ({}, {"compute_out": {"occupancy": 3}}, False),
    "out occ 4": ({}, {"compute_out": {"occupancy": 4}}, False),
    "out tf32 state": ({"compute_out": {"SBF": False}}, {}, False),
    "index32 out occ 2": ({}, {"compute_out": {"occupancy": 2}}, True),
    "index32 out occ 3": ({}, {"compute_out": {"occupancy": 3}}, True),
    "index32 state occ 2": ({}, {"chunk_state": {"occupancy": 2}}, True),
    "index32 state occ 4": ({}, {"chunk_state": {"occupancy": 4}}, True),
    "index32 state TN128": ({"chunk_state": {"TN": 128}}, {}, True),
    "index32 out TN128": ({"compute_out": {"TN": 128}}, {}, True),
    "cb bf16": ({}, {}, False, "cb16"),
    "index32 cb bf16": ({}, {}, True, "cb16"),
    "states bf16": ({}, {}, False, "states16"),
    "index32 states+cb bf16": ({}, {}, True, "cb16", "states16"),
    # chunk_state with longer token steps (fewer dependent load -> mma rounds per program), on the defaults
    "state BL128": ({"chunk_state": {"BL": 128}}, {}, True, "cb16", "states16"),
    "state BL256": ({"chunk_state": {"BL": 256}}, {}, True, "cb16", "states16"),
    "state BL128 TN128": ({"chunk_state": {"BL": 128, "TN": 128}}, {}, True, "cb16", "states16"),
    "state BL128 occ 2": ({"chunk_state": {"BL": 128}}, {"chunk_state": {"occupancy": 2}}, True, "cb16", "states16"),
    "state BL256 occ 2": ({"chunk_state": {"BL": 256}}, {"chunk_state": {"occupancy": 2}}, True, "cb16", "states16"),
    "state BL128 occ 4": ({"chunk_state": {"BL": 128}}, {"chunk_state": {"occupancy": 4}}, True, "cb16", "states16"),
    # the defaults, and chunk_state's occupancy hint again now that its dstate tile is 128 wide (v10)
    "defaults": ({}, {}, True, "cb16", "states16", "local16"),
    "state occ 2": ({}, {"chunk_state": {"occupancy": 2}}, True, "cb16", "states16"),
    "state occ 3": ({}, {"chunk_state": {"occupancy": 3}}, True, "cb16", "states16"),
    "state no occ": ({}, {"chunk_state": {}}, True, "cb16", "states16"),
    "out occ 3 (defaults)": ({}, {"compute_out": {"occupancy": 3}}, True, "cb16", "states16"),
    # compute_out's occupancy hint again after v21, on today's defaults (local states in bf16 too)
    "out occ 2 (v21)": ({}, {"compute_out": {"occupancy": 2}}, True, "cb16", "states16", "local16"),
    "out occ 3 (v21)": ({}, {"compute_out": {"occupancy": 3}}, True, "cb16", "states16", "local16"),
    "out no occ (v21)": ({}, {"compute_out": {}}, True, "cb16", "states16", "local16"),
    "out occ 5 (v21)": ({}, {"compute_out": {"occupancy": 5}}, True, "cb16", "states16", "local16"),
    "out occ 6 (v21)": ({}, {"compute_out": {"occupancy": 6}}, True, "cb16", "states16", "local16"),
    # compute_out (and chunk_cb) with 128-row blocks at chunk 256: half a walk step per program on average instead
    # of 1.5, each twice the work (tileiras 13.4, sm_90: 128 registers and small spills at occupancy 2)
    "out BL128 occ 2": ({"compute_out": {"BL": 128}}, {"compute_out": {"occupancy": 2}}, True, "cb16", "states16",
                        "local16"),
    "out BL128 occ 3": ({"compute_out": {"BL": 128}}, {"compute_out": {"occupancy": 3}}, True, "cb16", "states16",
                        "local16"),
    # (Clusters of two CTAs and eight worker warps were tried in the eighteenth session: a misaligned-address
    # fault and 47% slower; docs/performance-log.md v28.)
    # chunk_state with HB heads per program (each B tile read once per HB heads), on the defaults; registers
    # in tileiras 13.4's sm_90 build: HB2 TN128 247 (occupancy 2), HB2 TN64 128, HB4 TN64 255 (occupancy 2)
    "state HB2 occ 2": ({"chunk_state": {"HB": 2}}, {"chunk_state": {"occupancy": 2}}, True, "cb16", "states16"),
    "state HB2 TN64": ({"chunk_state": {"HB": 2, "TN": 64}}, {}, True, "cb16", "states16"),
    "state HB4 TN64 occ 2": ({"chunk_state": {"HB": 4, "TN": 64}}, {"chunk_state": {"occupancy": 2}}, True, "cb16",
                             "states16"),
    # chunk_state's local states stored in bfloat16 (launch.LOCAL_STATES_IN_BF16): the defaults since v16, and
    # the defaults before it
    "local states bf16": ({}, {}, True, "cb16", "states16", "local16"),
    "local states float32": ({}, {}, True, "cb16", "states16"),
    # chunk_state's dstate tile fitted to dstate 64 (launch.CHUNK_STATE_TN is 128: half of each B tile and of
    # each product is padding there), at HB 2's occupancy 2 and at 4
    "state TN64": ({"chunk_state": {"TN": 64}}, {}, True, "cb16", "states16", "local16"),
    "state TN64 occ 4": ({"chunk_state": {"TN": 64}}, {"chunk_state": {"occupancy": 4}}, True, "cb16", "states16",
                         "local16"),
    # chunk_state at short sequences (T=1K: 4 chunks, 320 programs at HB 2 for 132 SMs): one head per program,
    # and 64-wide dstate tiles, for more programs
    "state HB1": ({"chunk_state": {"HB": 1}}, {}, True, "cb16", "states16", "local16"),
    "state HB1 TN64": ({"chunk_state": {"HB": 1, "TN": 64}}, {}, True, "cb16", "states16", "local16"),
}
# state_passing's block ("sblk<n>": STATE_BLOCK_OVERRIDE, 256 included, which the compile list does not hold),
# and its local-state loads bounds-checked where the block divides the state (CHK True: a zero-padded load),
# on the defaults
_DEFAULT_FLAGS = ("cb16", "states16", "local16")
for _blk in (256, 512, 1024, 2048, 4096):
    VARIANTS[f"sp blk{_blk}"] = ({}, {}, True, *_DEFAULT_FLAGS, f"sblk{_blk}")
    VARIANTS[f"sp blk{_blk} checked"] = ({"state_passing": {"CHK": True}}, {}, True, *_DEFAULT_FLAGS, f"sblk{_blk}")
# Occupancy hints of chunk_cb (4 by default since one sweep: without one tileiras 13.4's sm_90 build takes 255
# registers at 256 threads and 161 KB of shared memory, one CTA per SM), chunk_cumsum (none: 151 registers at 128
# threads at chunk 256) and state_passing (none); "<kernel> no occ" removes the table's hint
for _name in ("chunk_cb", "chunk_cumsum", "state_passing"):
    for _occ in (2, 4, 8):
        VARIANTS[f"{_name} occ {_occ}"] = ({}, {_name: {"occupancy": _occ}}, True, *_DEFAULT_FLAGS)
    VARIANTS[f"{_name} no occ"] = ({}, {_name: {}}, True, *_DEFAULT_FLAGS)

# chunk_state's occupancy above the table's 4 (one head per program at dstate <= 64 holds a (64, 64) float32 state:
# at 4K tokens its 1,280 programs are 2.4 waves at 4 per SM), and chunk_cumsum with fewer heads per program (80
# programs at 4K tokens, H=80, for 132 SMs, with the 16 heads it took before v37)
for _occ in (5, 6, 8):
    VARIANTS[f"state occ {_occ}"] = ({}, {"chunk_state": {"occupancy": _occ}}, True, *_DEFAULT_FLAGS)
for _bh in (1, 2, 4, 8, 16):
    VARIANTS[f"cumsum BH {_bh}"] = ({"chunk_cumsum": {"BH": _bh}}, {}, True, *_DEFAULT_FLAGS)

# compute_out_carry in place of compute_out's walk (launch.OUT_CARRY_OVERRIDE), at occupancy hints and headdim tiles
for _occ in (1, 2, 3, 4):
    VARIANTS[f"out carry occ {_occ}"] = ({}, {"compute_out_carry": {"occupancy": _occ}}, True, *_DEFAULT_FLAGS,
                                         "carry")
    VARIANTS[f"out carry TP32 occ {_occ}"] = ({"compute_out_carry": {"TP": 32}},
                                              {"compute_out_carry": {"occupancy": _occ}}, True, *_DEFAULT_FLAGS,
                                              "carry")
# ... with the table's hints, and compute_out's walk where the carry would be the default
VARIANTS["out carry"] = ({}, {}, True, *_DEFAULT_FLAGS, "carry")
VARIANTS["out walk"] = ({}, {}, True, *_DEFAULT_FLAGS, "walk")
# the caller's chunk kept at every length ("nosuper": launch.SUPER_CHUNK_DEFAULT_SEQLEN out of reach), e.g. chunks
# of 128 at 4K tokens with --chunk 128, with either of compute_out's kernels
VARIANTS["nosuper"] = ({}, {}, True, *_DEFAULT_FLAGS, "nosuper")
VARIANTS["nosuper out carry"] = ({}, {}, True, *_DEFAULT_FLAGS, "nosuper", "carry")
VARIANTS["nosuper out walk"] = ({}, {}, True, *_DEFAULT_FLAGS, "nosuper", "walk")
# the output kernel's chunks last first (launch.OUT_REVERSE, the default) or first to last, on the defaults and
# with the walk forced
VARIANTS["out reverse"] = ({}, {}, True, *_DEFAULT_FLAGS, "rev")
VARIANTS["out forward"] = ({}, {}, True, *_DEFAULT_FLAGS, "norev")
VARIANTS["out walk reverse"] = ({}, {}, True, *_DEFAULT_FLAGS, "walk", "rev")
VARIANTS["out walk forward"] = ({}, {}, True, *_DEFAULT_FLAGS, "walk", "norev")
# chunk_cb's programs in chunk_state's launch (launch.FUSED_CB; the planned forward, so no overrides with it)
VARIANTS["fused cb"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcb")
VARIANTS["fused cb walk"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcb", "walk")
# ... and chunk_cumsum's work in that launch too (launch.FUSED_CUMSUM, chunk 256; the default up to
# FUSED_CUMSUM_MAX_CHUNKS chunks: these variants at any length, "unfused" at none)
VARIANTS["unfused"] = ({}, {}, True, *_DEFAULT_FLAGS, "unfused")
VARIANTS["fused cumsum"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcumsum")
VARIANTS["fused cumsum walk"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcumsum", "walk")
# state_passing's work in chunk_state's launch (launch.FUSED_PASS, up to four chunks), alone and with each of the two
VARIANTS["fused pass"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedpass")
VARIANTS["fused cb pass"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcb", "fusedpass")
VARIANTS["fused cumsum pass"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcumsum", "fusedpass")
# ... its walk a head at a time (launch.FUSED_PASS_BY_HEAD: no spills at two heads, twice the steps)
VARIANTS["fused cumsum pass by head"] = ({}, {}, True, *_DEFAULT_FLAGS, "fusedcumsum", "fusedpass", "byhead")


@contextlib.contextmanager
def variant(name):
    """The module's switches set as VARIANTS[name] says for the duration, then restored."""
    defaults = (index_width.NARROW_INDEX, launch.CB_IN_BF16, launch.STATES_IN_BF16, launch.LOCAL_STATES_IN_BF16,
                launch.STATE_BLOCK_OVERRIDE, launch.OUT_CARRY_OVERRIDE, launch.SUPER_CHUNK_DEFAULT_SEQLEN,
                launch.OUT_REVERSE, launch.FUSED_CB, launch.FUSED_CUMSUM, launch.FUSED_PASS, launch.FUSED_PASS_BY_HEAD,
                launch.FUSED_CUMSUM_MAX_CHUNKS)
    default_cumsum, default_reverse = launch.FUSED_CUMSUM, launch.OUT_REVERSE
    consts, hints, narrow, *flags = VARIANTS[name]
    launch.FUSED_CB = "fusedcb" in flags
    # "fusedcumsum" at any length; the other fused variants and "unfused" without it; else the default (on for
    # short sequences)
    launch.FUSED_CUMSUM = "fusedcumsum" in flags or (
        default_cumsum and not any(f.startswith("fused") or f == "unfused" for f in flags))
    if "fusedcumsum" in flags:
        launch.FUSED_CUMSUM_MAX_CHUNKS = 1 << 30
    launch.FUSED_PASS = "fusedpass" in flags
    launch.FUSED_PASS_BY_HEAD = "byhead" in flags
    launch.OUT_REVERSE = "rev" in flags or ("norev" not in flags and default_reverse)
    if "nosuper" in flags:
        launch.SUPER_CHUNK_DEFAULT_SEQLEN = 1 << 62
    launch.OUT_CARRY_OVERRIDE = True if "carry" in flags else False if "walk" in flags else None
    launch.STATE_BLOCK_OVERRIDE = next((int(f[4:]) for f in flags if f.startswith("sblk")), None)
    index_width.NARROW_INDEX = narrow
    launch.CB_IN_BF16 = "cb16" in flags
    launch.STATES_IN_BF16 = "states16" in flags
    launch.LOCAL_STATES_IN_BF16 = "local16" in flags
    launch.CONSTANT_OVERRIDE.clear()
    launch.CONSTANT_OVERRIDE.update(consts)
    launch.HINT_OVERRIDE.clear()
    launch.HINT_OVERRIDE.update(hints)
    try:
        yield
    finally:
        launch.CONSTANT_OVERRIDE.clear()
        launch.HINT_OVERRIDE.clear()
        (index_width.NARROW_INDEX, launch.CB_IN_BF16, launch.STATES_IN_BF16,
         launch.LOCAL_STATES_IN_BF16, launch.STATE_BLOCK_OVERRIDE, launch.OUT_CARRY_OVERRIDE,
         launch.SUPER_CHUNK_DEFAULT_SEQLEN, launch.OUT_REVERSE, launch.FUSED_CB, launch.FUSED_CUMSUM,
         launch.FUSED_PASS, launch.FUSED_PASS_BY_HEAD, launch.FUSED_CUMSUM_MAX_CHUNKS) = defaults


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16K:128,64K:256")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        T, N, L = parse_sizes(t_s)[0], int(n_s), args.chunk
        case = scan_case(T, N, L)
        call = lambda: public_call(case, return_final_states=True)  # noqa: E731
        # errors are against the 64-bit-indexed kernels with float32 C . B^T and states
        with variant("index64"):
            y0, fin0 = call()
        for name in args.variants.split(","):
            t0 = time.time()
            try:
                with variant(name):
                    y, fin = call()
                    r = dict(T=T, N=N, L=L, variant=name, err_y=rel_err(y, y0), err_final=rel_err(fin, fin0),
                             ms=_median_ms(call), kernels=_kernel_times(call))
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                r = dict(T=T, N=N, L=L, variant=name, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(r)
            if "error" in r:
                print(f"T={T} N={N} {name:15s} ERROR {r['error']}", flush=True)
                continue
            ks = "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items())
            print(f"T={T} N={N} {name:15s} {r['ms']:.3f} ms  err y {r['err_y']:.1e} fin {r['err_final']:.1e}  "
                  f"({time.time() - t0:.0f}s)  {ks}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
