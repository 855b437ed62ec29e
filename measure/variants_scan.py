"""Variants of the two-op forward path side by side on a GPU, as a script (the experiments behind
docs/history.md):

    python measure/variants_scan.py [--shapes 16K:128,64K:256] [--chunk 256] [--variants a,b,...]
                                    [--json OUT/variants.json]

Each variant sets knobs of m2ops.kernels.config (config.override: index32, out_carry, out_reverse, state_block,
super_chunk_min_seqlen, fused_cumsum / fused_cumsum_max_chunks, chunk_state_heads) and ct.kernel hints of named
kernels (harness.hints: occupancy), runs the public call, checks y and the final state against the
64-bit-indexed kernels' ("index64": config index32 off; relative error), and reports the median call time
(host-free: harness.median_ms with HOST_FREE) and each kernel's time (torch profiler). --variants:
comma-separated names of VARIANTS (default: all of them). Shapes as profile_scan.py: B=1, H=80, P=64, G=1, bf16
x/B/C, fp32 dt, D, initial and final states. Tuning is off. Knobs a variant does not name keep
config.current()'s values (the environment's M2OPS_INDEX32 and M2OPS_PDL included).

The experiments that replaced the kernels' compile-time constants (bounds checks, compute_out's tf32 state
product, dstate and headdim tiles, row blocks, chunk_cumsum's heads per program, state_passing's checked loads)
or switched the bfloat16 intermediates off (C . B^T, the entering states, the local states: now fixed behaviour)
are gone with the package's hooks for them; their results are in docs/history.md, and the driver that ran them
is tests/gpu/variants_scan.py at commit 1f36d14.
"""

from __future__ import annotations

import contextlib
import time

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, rel_err, scan_case

from m2ops.kernels import config


def _v(hints=None, **knobs) -> dict:
    """A variant: config knobs (config.override's keywords) and kernel name -> ct.kernel hints (harness.hints)."""
    return {"config": knobs, "hints": hints or {}}


def _occ(kernel: str, occ) -> dict:
    """hints that set kernel's occupancy to occ (None: no hint at all, {})."""
    return {kernel: {} if occ is None else {"occupancy": occ}}


# The 32-bit-indexed twins off (the reference of every variant's error) and on; the launcher's defaults.
VARIANTS = {
    "index64": _v(index32=False),
    "index32": _v(index32=True),
    "defaults": _v(),
}
# chunk_state with HB heads per program (each B tile read once per HB heads; config chunk_state_heads): one head
# per program at short sequences (T=1K: 4 chunks, 320 programs at HB 2 for 132 SMs), and two at occupancy 2
VARIANTS["state HB1"] = _v(chunk_state_heads=1)
VARIANTS["state HB2 occ 2"] = _v(_occ("chunk_state", 2), chunk_state_heads=2)
# chunk_state's and compute_out's occupancy hints ("<kernel> no occ": none at all, the table's removed)
for _occ_k in (2, 3, 4, 5, 6, 8):
    VARIANTS[f"state occ {_occ_k}"] = _v(_occ("chunk_state", _occ_k))
VARIANTS["state no occ"] = _v(_occ("chunk_state", None))
for _occ_k in (2, 3, 4, 5, 6):
    VARIANTS[f"out occ {_occ_k}"] = _v(_occ("compute_out", _occ_k))
VARIANTS["out no occ"] = _v(_occ("compute_out", None))
# state_passing's block ("sp blk<n>": config state_block, 256 included, which the compile list does not hold)
for _blk in (256, 512, 1024, 2048, 4096):
    VARIANTS[f"sp blk{_blk}"] = _v(state_block=_blk)
# Occupancy hints of chunk_cb (4 by default since one sweep: without one tileiras 13.4's sm_90 build takes 255
# registers at 256 threads and 161 KB of shared memory, one CTA per SM), chunk_cumsum (none: 151 registers at 128
# threads at chunk 256) and state_passing (none); "<kernel> no occ" removes the table's hint
for _name in ("chunk_cb", "chunk_cumsum", "state_passing"):
    for _occ_k in (2, 4, 8):
        VARIANTS[f"{_name} occ {_occ_k}"] = _v(_occ(_name, _occ_k))
    VARIANTS[f"{_name} no occ"] = _v(_occ(_name, None))
# compute_out_carry in place of compute_out's walk (config out_carry), at occupancy hints
for _occ_k in (1, 2, 3, 4):
    VARIANTS[f"out carry occ {_occ_k}"] = _v(_occ("compute_out_carry", _occ_k), out_carry=True)
# ... with the table's hints, and compute_out's walk where the carry would be the default
VARIANTS["out carry"] = _v(out_carry=True)
VARIANTS["out walk"] = _v(out_carry=False)
# the caller's chunk kept at every length ("nosuper": config super_chunk_min_seqlen out of reach), e.g. chunks
# of 128 at 4K tokens with --chunk 128, with either of compute_out's kernels
_NOSUPER = 1 << 62
VARIANTS["nosuper"] = _v(super_chunk_min_seqlen=_NOSUPER)
VARIANTS["nosuper out carry"] = _v(super_chunk_min_seqlen=_NOSUPER, out_carry=True)
VARIANTS["nosuper out walk"] = _v(super_chunk_min_seqlen=_NOSUPER, out_carry=False)
# the output kernel's chunks last first (config out_reverse, the default) or first to last, on the defaults and
# with the walk forced
VARIANTS["out reverse"] = _v(out_reverse=True)
VARIANTS["out forward"] = _v(out_reverse=False)
VARIANTS["out walk reverse"] = _v(out_carry=False, out_reverse=True)
VARIANTS["out walk forward"] = _v(out_carry=False, out_reverse=False)
# chunk_cb's programs and chunk_cumsum's work in chunk_state's launch (config fused_cumsum, chunk 256; the default up
# to fused_cumsum_max_chunks chunks: these variants at any length, "unfused" at none)
_ANY_LENGTH = 1 << 30
VARIANTS["unfused"] = _v(fused_cumsum=False)
VARIANTS["fused cumsum"] = _v(fused_cumsum=True, fused_cumsum_max_chunks=_ANY_LENGTH)
VARIANTS["fused cumsum walk"] = _v(fused_cumsum=True, fused_cumsum_max_chunks=_ANY_LENGTH, out_carry=False)


@contextlib.contextmanager
def variant(name):
    """config.current() and the kernels' hints as VARIANTS[name] says for the duration, then restored."""
    v = VARIANTS[name]
    with config.override(**v["config"]), harness.hints(v["hints"]):
        yield


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128,64K:256")
    harness.add_chunk(ap)
    ap.add_argument("--variants", type=harness.names, default=",".join(VARIANTS),
                    help="comma-separated names of VARIANTS (default: all)")
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for T, N, _ in args.shapes:
        L = args.chunk
        case = scan_case(T, N, L)
        call = lambda: public_call(case, return_final_states=True)  # noqa: E731
        # errors are against the 64-bit-indexed kernels
        with variant("index64"):
            y0, fin0 = call()
        for name in args.variants:
            t0 = time.time()
            try:
                with variant(name):
                    y, fin = call()
                    r = dict(T=T, N=N, L=L, variant=name, err_y=rel_err(y, y0), err_final=rel_err(fin, fin0),
                             ms=harness.median_ms(call, **harness.HOST_FREE), kernels=harness.kernel_times(call))
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                r = dict(T=T, N=N, L=L, variant=name, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(r)
            if "error" in r:
                print(f"T={T} N={N} {name:15s} ERROR {r['error']}", flush=True)
                continue
            ks = "  ".join(f"{k} {v:.3f}" for k, v in r["kernels"].items())
            print(f"T={T} N={N} {name:15s} {r['ms']:.3f} ms  err y {r['err_y']:.1e} fin {r['err_final']:.1e}  "
                  f"({time.time() - t0:.0f}s)  {ks}", flush=True)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
