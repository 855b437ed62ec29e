"""Upper bounds by omission (an experiment, results are wrong by design): the public call's time, replayed from a
CUDA graph and eager, with the launches of named kernels dropped. What a kernel's removal would save is at most
the difference to the defaults.

    python measure/skip_scan.py [--shapes 1K:256,64K:64] [--skips "-,chunk_cb_kernel,..."] [--chunk 256] [--json OUT]

--skips: comma-separated settings, each "-" (nothing dropped) or kernel names joined by "+".
"""

from __future__ import annotations

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops.kernels import runtime

_REAL = runtime.launch


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:256,1K:512,4K:64,16K:128,64K:64")
    ap.add_argument("--skips", type=harness.names,
                    default="-,chunk_cb_kernel,chunk_cumsum_kernel,chunk_cb_kernel+chunk_cumsum_kernel,-")
    harness.add_chunk(ap)
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for T, N, _ in args.shapes:
        case = scan_case(T, N, args.chunk)
        for skip in args.skips:
            names = set() if skip == "-" else set(skip.split("+"))

            def patched(grid, kernel, a, pdl=None, arrays=None, slot=None):
                if kernel._pyfunc.__name__ in names:
                    return None
                return _REAL(grid, kernel, a, pdl, arrays, slot)

            runtime.launch = patched
            try:
                eager = harness.median_ms(lambda: public_call(case))
                replay = harness.graphed(lambda: public_call(case))
                graph = harness.median_ms(replay)
            finally:
                runtime.launch = _REAL
            row = dict(T=T, N=N, skip=skip, eager_ms=eager, graph_ms=graph)
            print(row, flush=True)
            rows.append(row)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
