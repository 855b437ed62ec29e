"""Experiment: chunks longer than 256 tokens for short sequences, under CUDA graphs.

    python tests/gpu/big_chunk.py [--shapes 1K:64,1K:256,1K:512] [--chunks 256,512,1024] [--json OUT]

At T=1K and chunk 256 the call is four chunks: chunk_state writes four local states per head, state_passing
walks them, compute_out reads them back. With one chunk of 1024 the state pass has nothing to pass and every
row block's output comes from the C . B^T walk instead (up to 15 column blocks). This times the public call at
each chunk size (graph replay with PDL, the bench's protocol) and compares y and the final state with chunk
256's. Chunk sizes above 256 are not in common.CHUNK_SIZES, so allow() adds them for the run, with chunk 256's
occupancy hints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops.bench.peers import _graphed  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.bench.timing import median_ms  # noqa: E402
from m2ops.kernels import common, launch  # noqa: E402


@contextlib.contextmanager
def allow(chunks):
    """common.CHUNK_SIZES with chunks added; their hints are chunk 256's."""
    old = (common.CHUNK_SIZES, dict(launch._OCCUPANCY), dict(launch.CHUNK_STATE_HEADS))
    common.CHUNK_SIZES = tuple(sorted(set(common.CHUNK_SIZES) | set(chunks)))
    for L in chunks:
        for (name, d, c), occ in old[1].items():
            if c == 256:
                launch._OCCUPANCY[(name, d, L)] = occ
        for (d, c), v in old[2].items():
            if c == 256:
                launch.CHUNK_STATE_HEADS[(d, L)] = v
    launch._table_kernel.cache_clear()
    try:
        yield
    finally:
        common.CHUNK_SIZES = old[0]
        launch._OCCUPANCY.clear()
        launch._OCCUPANCY.update(old[1])
        launch.CHUNK_STATE_HEADS.clear()
        launch.CHUNK_STATE_HEADS.update(old[2])
        launch._table_kernel.cache_clear()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1K:64,1K:128,1K:256,1K:512")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    with allow([c for c in chunks if c > 256]):
        for spec in args.shapes.split(","):
            t_s, n_s = spec.split(":")
            case = scan_case(parse_sizes(t_s)[0], int(n_s), 256)
            base = None
            for L in chunks:
                case["chunk_size"] = L
                row = dict(T=case["x"].shape[1], N=int(n_s), L=L)
                try:
                    result = []
                    replay = _graphed(lambda: result.append(public_call(case)))
                    replay()
                    torch.cuda.synchronize()
                    out = tuple(t.clone() for t in result[-1])
                    row["ms"] = [median_ms(replay, device="cuda") for _ in range(2)]
                    if base is None:
                        base = out
                    row["y_vs_first"] = _rel(out[0], base[0])
                    row["final_vs_first"] = _rel(out[1], base[1])
                except Exception as e:  # noqa: BLE001 - recorded, the next chunk size still runs
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(row, flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
