"""Pieces every kernel module shares: parameter annotations, the tile-size rules, and the set of chunk sizes
and dtypes the kernels are built for.

Tile sizes are functions of the chunk size alone, so that a kernel's specialisations are exactly
(dtype, chunk size[, seq_idx present]); specs.py enumerates them from the same functions the launchers call.
"""

from __future__ import annotations

import cuda.tile as ct

# Arrays that can pass 2^31 elements (activations, chunk states) use 64-bit shapes and strides, so that tile
# offsets are computed in 64 bits. The small per-head vectors keep 32-bit indexing.
Big = ct.IndexedWithInt64[ct.Array]
ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

CHUNK_SIZES = (16, 32, 64, 128, 256)

# dtypes of x / B / C / z (and of dt for chunk_cumsum) that have kernels; float64 runs the reference.
INPUT_DTYPES = ("float16", "bfloat16", "float32")

# Tiles over headdim and dstate: fixed, so that they do not multiply the specialisations. headdim and
# dstate of any size are covered by several tiles, the last one partial (zero-padded loads, clipped stores).
TILE_P = 64
TILE_N = 64
# Heads per chunk_cumsum program.
TILE_H = 16

# state_passing: elements of one head's flattened (headdim x dstate) state per program. The launcher picks
# the largest that still gives enough programs to fill the GPU (state_passing_block); specs.py builds all.
STATE_BLOCKS = (512, 1024, 2048, 4096)
# Programs per SM state_passing aims for: each keeps one block load in flight, and about 4-5 MB must be in
# flight to cover HBM latency at full bandwidth (4 per SM x 132 SMs x 4-8 KB).
STATE_PROGRAMS_PER_SM = 4
# Latency hint (1-10) of the streaming loads of the chunks' local states in state_passing.
STATE_LOAD_LATENCY = 10


def sub_block(chunk_size: int) -> int:
    """Token rows per step inside a chunk (the mma K extent of the state pass, the row and column block of
    the output pass): at most 64, so that the (rows x rows) decay tile and the accumulators stay in
    registers."""
    return min(chunk_size, 64)


def supported_chunk_size(chunk_size: int) -> bool:
    return chunk_size in CHUNK_SIZES


def cdiv(a, b):
    return (a + b - 1) // b
