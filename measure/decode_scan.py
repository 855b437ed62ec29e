"""The functional decode step (m2ops::state_update) at several batch sizes with and without an occupancy hint, as a script:

    python measure/decode_scan.py [--batches 1,16,64,256] [--dstates 128,256] [--occupancy 0,2,4,8] [--odd-grid]
                                  [--no-timing] [--json OUT]

H=80, P=64, G=1, bfloat16 x/B/C/z, float32 dt, D, dt_bias and state (the layer's decode cache), dt_softplus.
Each setting's call is captured in a CUDA graph and its replay timed by the benchmark's protocol
(harness.median_ms: L2 flushed before each run, median of 100). Occupancy 0 is the launcher's choice (its
table, or decode.STATE_UPDATE_ALIGNED_OCCUPANCY where every tiled array has 16-byte rows); k sets state_update's
occupancy to k for every build (harness.hints). y and the new state of every setting must match the table's to the
bit (the hint changes the schedule, not the arithmetic); a row says when not.

Then each occupancy runs the example of tests/gpu/test_state_update_kernel.py (ODD_CASE) that occupancy 4 and 8
got wrong on the H200 (2026-12-02: batch 3, 8 heads, headdim 50, dstate 100, bfloat16 state and D per channel),
against the reference: a row with its relative errors and the count of outputs left unwritten (NaN: the
allocator is poisoned). A hint is fit for the launcher's table (m2ops/kernels/specialise.py) only where that row is
right too.
"""

from __future__ import annotations

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import STRIDE_CLASSES, poison_allocator, rel_err  # (and M2OPS_AUTOTUNE=0: the table's hints)

from m2ops.kernels import decode
from m2ops.ops.state_update import selective_state_update_functional

H, P, G = 80, 64, 1

# Around the odd case (test_state_update_kernel.ODD_CASE): which of its unusual properties (headdim 50: a partial
# last row tile; dstate 100: 200-byte rows of a bfloat16 state, not a multiple of 16 bytes; the bfloat16 state) the
# wrong results need.
ODD_GRID = [dict(headdim=p, dstate=n, state_dtype=sd) for p, n in STRIDE_CLASSES
            for sd in (torch.bfloat16, torch.float32)]


def odd_case_row(occ, **change):
    """The failing test example (with `change` applied) at occupancy occ (0: the table's): relative errors and
    unwritten outputs."""
    import test_state_update_kernel as tsu  # (tests/gpu, on the path through harness)

    from m2ops.reference import state_update as ref
    case = {**tsu.ODD_CASE, **change}
    kw = tsu.make_inputs(**case)
    ey, enew = ref.state_update(**tsu._cpu(kw))
    with harness.hints(_occupancy(occ)):
        poison_allocator()
        y, new = decode.state_update(**kw)
        torch.cuda.synchronize()
    return dict(case="odd", headdim=case["headdim"], dstate=case["dstate"], state=str(case["state_dtype"])[6:],
                occupancy=occ or "table", err_y=rel_err(y, ey), err_state=rel_err(new, enew),
                unwritten=int(y.isnan().sum() + new.isnan().sum()))


def _occupancy(occ) -> dict:
    """harness.hints' overrides for occupancy occ of state_update (0: none, the launcher's table)."""
    return {"state_update": {"occupancy": occ}} if occ else {}


def _inputs(batch, n):
    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + n)
    dev, bf = "cuda", torch.bfloat16

    def r(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype)
    return dict(state=r(batch, H, P, n, dtype=torch.float32), x=r(batch, H, P), dt=r(batch, H, dtype=torch.float32),
                A=-torch.rand(H, generator=g, device=dev), B=r(batch, G, n), C=r(batch, G, n),
                D=r(H, dtype=torch.float32), z=r(batch, H, P), dt_bias=r(H, dtype=torch.float32), dt_softplus=True)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--batches", type=harness.sizes, default="1,16,64,256")
    ap.add_argument("--dstates", type=harness.sizes, default="128,256")
    ap.add_argument("--occupancy", type=harness.sizes, default="0,2,4,8", help="0: the launcher's table")
    ap.add_argument("--odd-grid", action="store_true",
                    help="the odd case at headdim 50/64 x dstate 100/128 x bfloat16/float32 state, not only its own")
    ap.add_argument("--no-timing", action="store_true", help="only the odd case's rows (e.g. under compute-sanitizer)")
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for n in ([] if args.no_timing else args.dstates):
        for batch in args.batches:
            inp = _inputs(batch, n)
            base = None
            for occ in args.occupancy:
                out = []
                row = dict(batch=batch, N=n, occupancy=occ or "table")
                try:
                    with harness.hints(_occupancy(occ)):
                        replay = harness.graphed(lambda: out.append(selective_state_update_functional(**inp)))
                        replay()
                        torch.cuda.synchronize()
                        row["ms"] = harness.median_ms(replay)
                except Exception as e:  # noqa: BLE001 - recorded, the other settings still run
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                else:
                    res = tuple(t.clone() for t in out[-1])
                    base = res if base is None else base
                    row["same_bits"] = all(torch.equal(a, b) for a, b in zip(base, res))
                print(row, flush=True)
                rows.append(row)
    for change in (ODD_GRID if args.odd_grid else [{}]):
        for occ in args.occupancy:
            row = odd_case_row(occ, **change)
            print(row, flush=True)
            rows.append(row)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
