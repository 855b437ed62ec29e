"""Experiment: chunks longer than 256 tokens for short sequences, under CUDA graphs.

    python measure/big_chunk.py [--shapes 1K:64,1K:256,1K:512] [--chunks 256,512,1024] [--json OUT]

At T=1K and chunk 256 the call is four chunks: chunk_state writes four local states per head, state_passing
walks them, compute_out reads them back. With one chunk of 1024 the state pass has nothing to pass and every
row block's output comes from the C . B^T walk instead (up to 15 column blocks). This times the public call at
each chunk size (graph replay with PDL, the bench's protocol) and compares y and the final state with chunk
256's. Chunk sizes above 256 are not among the kernels' chunk sizes (common.CHUNK_SIZES, and
meta.shapes.KERNEL_CHUNK_SIZES, which the dispatch checks), so allow() adds them for the run (harness.constants),
with chunk 256's occupancy hints.
"""

from __future__ import annotations

import contextlib

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, rel_err, scan_case

from m2ops.kernels import common, specialise
from m2ops.meta import shapes as meta_shapes


@contextlib.contextmanager
def allow(chunks):
    """The kernels' chunk sizes with chunks added, wherever the package reads them (harness.constants); their hints
    are chunk 256's (added to specialise's tables, restored after)."""
    sizes = tuple(sorted(set(common.CHUNK_SIZES) | set(chunks)))
    names = {"CHUNK_SIZES": sizes}
    if hasattr(meta_shapes, "KERNEL_CHUNK_SIZES"):
        names["KERNEL_CHUNK_SIZES"] = sizes
    with harness.constants(**names):  # (the kept plans and hinted kernels forgotten on entry and exit)
        old = (dict(specialise._OCCUPANCY), dict(specialise.CHUNK_STATE_HEADS))
        for L in chunks:
            for (name, d, c), occ in old[0].items():
                if c == 256:
                    specialise._OCCUPANCY[(name, d, L)] = occ
            for (d, c), v in old[1].items():
                if c == 256:
                    specialise.CHUNK_STATE_HEADS[(d, L)] = v
        try:
            yield
        finally:
            specialise._OCCUPANCY.clear()
            specialise._OCCUPANCY.update(old[0])
            specialise.CHUNK_STATE_HEADS.clear()
            specialise.CHUNK_STATE_HEADS.update(old[1])


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:64,1K:128,1K:256,1K:512")
    ap.add_argument("--chunks", type=harness.sizes, default="256,512,1024")
    harness.add_json(ap)
    args = ap.parse_args()
    chunks = args.chunks
    rows = []
    with allow([c for c in chunks if c > 256]):
        for T, N, _ in args.shapes:
            case = scan_case(T, N, 256)
            base = None
            for L in chunks:
                case["chunk_size"] = L
                row = dict(T=T, N=N, L=L)
                try:
                    result = []
                    replay = harness.graphed(lambda: result.append(public_call(case)))
                    replay()
                    torch.cuda.synchronize()
                    out = tuple(t.clone() for t in result[-1])
                    row["ms"] = [harness.median_ms(replay) for _ in range(2)]
                    if base is None:
                        base = out
                    row["y_vs_first"] = rel_err(out[0], base[0])
                    row["final_vs_first"] = rel_err(out[1], base[1])
                except Exception as e:  # noqa: BLE001 - recorded, the next chunk size still runs
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(row, flush=True)
                rows.append(row)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
