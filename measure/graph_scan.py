"""The public call replayed from a CUDA graph, with and without programmatic dependent launch, as a script:

    python measure/graph_scan.py [--shapes 1K:64,1K:128,1K:256,1K:512] [--chunk 256] [--json OUT]
                                 [--variants defaults,...]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states) and each
setting of config.current().pdl (config.override(pdl=...)), the call is captured in its own graph and its replay
timed by the benchmark's protocol (harness.median_ms: L2 flushed before each run, median of 100); the outputs of
the two settings must agree to the bit. Tuning is off (gpu_cases sets M2OPS_AUTOTUNE=0): the launcher's defaults, or with --variants the kernel
variants of measure/variants_scan.py (VARIANTS), one after the other.
"""

from __future__ import annotations

import contextlib

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case
from variants_scan import variant

from m2ops.kernels import config


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:64,1K:128,1K:256,1K:512")
    harness.add_chunk(ap)
    harness.add_json(ap)
    ap.add_argument("--variants", type=harness.names, default="",
                    help="comma-separated names from variants_scan.VARIANTS")
    args = ap.parse_args()
    rows = []
    for T, N, _ in args.shapes:
        case = scan_case(T, N, args.chunk)
        for name in (args.variants or [None]):
            with variant(name) if name else contextlib.nullcontext():
                rows.append(_replays(case, N, args.chunk, name))
    harness.write_json(args.json, rows)


def _replays(case, N, chunk, name):
    """The case's graph replay with and without PDL, twice each."""
    outs = {}
    row = dict(T=case["x"].shape[1], N=N, L=chunk, variant=name)
    for pdl in (False, True, False, True):  # twice each, interleaved, to see the spread
        result = []
        with config.override(pdl=pdl):
            try:
                replay = harness.graphed(lambda: result.append(public_call(case)))
                replay()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported, the other setting still runs
                row[f"pdl{int(pdl)}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"PDL={pdl}: {row[f'pdl{int(pdl)}_error']}", flush=True)
                continue
            outs[pdl] = tuple(t.clone() for t in result[-1])
            row.setdefault(f"pdl{int(pdl)}_ms", []).append(harness.median_ms(replay))
    same = len(outs) == 2 and all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    row["same_bits"] = same
    print(f"T={row['T']} N={row['N']} {name or ''}: graph replay ms without PDL {row.get('pdl0_ms')}, with PDL "
          f"{row.get('pdl1_ms')}; "
          f"same bits: {same}", flush=True)
    return row


if __name__ == "__main__":
    main()
