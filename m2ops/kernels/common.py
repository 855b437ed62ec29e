"""Pieces every kernel module shares: parameter annotations, the tile-size rules, and the set of chunk sizes
and dtypes the kernels are built for.

Tile sizes are functions of the chunk size alone, so that a kernel's specialisations are exactly
(dtype, chunk size[, seq_idx present]); specs.py enumerates them from the same functions the launchers call.
"""

from __future__ import annotations

import cuda.tile as ct

from ..meta.shapes import KERNEL_CHUNK_SIZES

# Arrays that can pass 2^31 elements (activations, chunk states) use 64-bit shapes and strides, so that tile
# offsets are computed in 64 bits. The small per-head vectors keep 32-bit indexing.
Big = ct.IndexedWithInt64[ct.Array]
ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

CHUNK_SIZES = KERNEL_CHUNK_SIZES

# dtypes of x / B / C / z (and of dt for chunk_cumsum) that have kernels; float64 runs the reference.
INPUT_DTYPES = ("float16", "bfloat16", "float32")

# Tiles over headdim and dstate: fixed, so that they do not multiply the specialisations. headdim and
# dstate of any size are covered by several tiles, the last one partial (zero-padded loads, clipped stores).
TILE_P = 64
TILE_N = 64
# Heads per chunk_cumsum program. Its programs are short and latency-bound (a load, a 256-step scan, two stores),
# so more programs of fewer heads finish sooner: 4 instead of 16 took the whole call under CUDA graphs on the H200
# from 89.5 to 86.1 us at T=4K N=64, 35.5 -> 33.2 at 1K N=64, 59.2 -> 55.7 at 1K N=256 (docs/history.md
# v37; 1 and 2 heads were no faster). 4 float32 heads are a 16-byte row, the least a TMA copy takes.
TILE_H = 4
# ... and per chunk_cumsum_bwd program (not measured at other values).
TILE_H_BWD = 16

# state_passing (and the backward's walk): elements of one head's flattened (headdim x dstate) state per
# program. The forward takes the smallest (specialise.forward_state_block), the backward's walk the largest that
# still gives enough programs to fill the GPU (specialise.backward_walk_block); the tuner tries all; specs.py
# builds all.
STATE_BLOCKS = (512, 1024, 2048, 4096)
# Programs per SM the backward's walk aims for: each keeps one block load in flight, and about 4-5 MB must be
# in flight to cover HBM latency at full bandwidth (4 per SM x 132 SMs x 4-8 KB).
STATE_PROGRAMS_PER_SM = 4
# Latency hint (1-10) of the streaming loads of the chunks' local states in state_passing.
STATE_LOAD_LATENCY = 10


# Fused scan (segments.py): a program holds a TP x NT float32 state tile in registers (NT = dstate rounded up
# to a power of two, TP = 64: 32 KB at NT = 128) and walks blocks of BL = 64 tokens.
SEGMENT_TP = 64
SEGMENT_BL = 64
# Programs per SM the fused scan's segment count aims for (scan.segment_count).
SEGMENT_PROGRAMS_PER_SM = 4
# When the launcher takes the fused scan (scan.use_segments): dstate <= SEGMENT_MAX_DSTATE, chunk size >= BL,
# and walks of at most SEGMENT_MAX_WALK blocks. Each block of a walk cost about 13 us (segment_state) and
# 26 us (segment_out) on an H200 at dstate 128, so the walk only pays where it is short; at dstate 256 and
# above the register-held state spilled (T=16K: 5.4 ms at N=256, 770 ms at N=512 with smaller tiles, against
# 1.7 and 3.0 ms for the two-op kernels). Measured (tests/gpu/profile_scan.py, B=1 H=80 P=64 bf16, chunk 256,
# ms): T=1K N=128, 3 blocks a segment: 0.385 fused, 0.574 two-op; T=4K N=128, 10 blocks: 0.455, 0.349;
# T=16K N=128, 37 blocks: 1.766, 1.146; T=16K N=64: 1.002, 0.814. Since v19 (docs/history.md) the
# two-op kernels win at T=1K as well: the tuner chose them at every dstate (the whole call under CUDA graphs,
# N=64: 0.043 ms tuned against 0.070 for the fused default; N=128: 0.045 against 0.088), so no walk is short
# enough for the default; the tuner still weighs the fused path (scan.chunk_scan_configs).
SEGMENT_MAX_WALK = 0
SEGMENT_MAX_DSTATE = 128
# Every NT the fused scan uses (specs.py builds each).
SEGMENT_NTS = (32, 64, 128)


def segment_tiles(dstate: int) -> tuple[int, int, int]:
    """(BL, TP, NT) of the fused scan at a dstate <= SEGMENT_MAX_DSTATE."""
    NT = 32
    while NT < dstate:
        NT *= 2
    return SEGMENT_BL, SEGMENT_TP, NT



def sub_block(chunk_size: int) -> int:
    """Token rows per step inside a chunk (the mma K extent of the state pass, the row and column block of
    the output pass): at most 64, so that the (rows x rows) decay tile and the accumulators stay in
    registers."""
    return min(chunk_size, 64)


def cdiv(a, b):
    return (a + b - 1) // b


def in_order(i, count, reverse):
    """Block i of count, or with reverse = 1 block count - 1 - i: a run-time flag, so that one build serves both
    orders (the config's out_reverse)."""
    return i + reverse * (count - 1 - 2 * i)


def dependent_launch_prologue():
    """First statement of every forward kernel. Launched with programmatic dependent launch (config.current().pdl, sm_90
    and later), a kernel's programs can be scheduled while the kernel before it in the stream is still
    finishing: the wait holds them until that kernel has completed and its writes are visible, before any load
    or store of this one, so only the launch and scheduling latency overlaps; launch_dependents then lets the
    next kernel's programs be scheduled in turn. Without PDL both are no-ops."""
    ct.grid_dependency_control_wait()
    ct.grid_dependency_control_launch_dependents()


def load_tile(array, index, shape, CHK):
    """A zero-padded, bounds-checked tile load; or, with CHK False (the launcher found every tile inside its
    array: specialise.tiles_in_bounds), an unchecked one, which saves the per-element bounds arithmetic.
    tileiras 13.4 rejects check_bounds=False together with a padding mode, hence the two calls."""
    if CHK:
        t = ct.load(array, index, shape=shape, padding_mode=ct.PaddingMode.ZERO)
    else:
        t = ct.load(array, index, shape=shape, check_bounds=False)
    return t


def mma_operand(t, LOWP):
    """A tensor-core operand of the backward kernels: bfloat16 under LOWP, else tf32 (t widened to float32)."""
    if LOWP:
        return t.astype(ct.bfloat16)
    return t.astype(ct.float32).astype(ct.tfloat32)


# log2(e): the kernels' exponentials are taken as 2**(x * LOG2E) (exp2 below).
LOG2E = 1.4426950408889634


def exp2(x):
    """2**x on the special-function unit (ex2.approx; subnormal results flushed to zero): one MUFU instruction,
    where ct.exp's correctly rounded form costs about eight. Its relative error (about 2**-22) is far below the
    bfloat16 rounding around it. The kernels evaluate one per element of their (BL x BL) weight blocks, where
    ct.exp had made compute_out issue-bound (docs/history.md, v19)."""
    return ct.exp2(x, flush_to_zero=True)


def silu(zf):
    """zf * sigmoid(zf) of a float32 tile (the z gate), with the exponential of exp2. The division is div.full
    (within 2 ulp over the whole float32 range): the default IEEE-rounded division adds a range check and a
    slow-path call per element. Where z is very negative the denominator is infinite and the result 0."""
    return ct.truediv(zf, 1.0 + exp2(zf * -LOG2E), rounding_mode=ct.RoundingMode.FULL)


def token_weight(cs_end, cs, dt):
    """exp(cs_end - cs) * dt: how much of a token's input survives to the position whose cumulative decay is
    cs_end (the end of its chunk or segment), times its step size; the weight of its x in a state."""
    return exp2((cs_end - cs) * LOG2E) * dt


def diag_decay(cs, keep):
    """exp(cs_l - cs_s) of a diagonal (BL x BL) block where keep (the causal, same-sequence mask), else 0: masked
    before the exp, since above the diagonal the difference is positive and could overflow."""
    csl = cs * LOG2E
    return exp2(ct.where(keep, csl[:, None] - csl[None, :], -float("inf")))


def weighted_state_product(xs, bs, w, acc):
    """acc + (w x)^T B for a block of tokens: xs (BL, TP) and bs (BL, TN) as loaded, w (BL,) each token's weight.
    The weights go on x, the operand that is transposed anyway, so that B's tile reaches the mma as loaded:
    weighting B instead (a scaled copy of it for the mma) made chunk_state 1.6x slower on the H200
    (docs/history.md v10)."""
    return ct.mma(ct.transpose(scale_by(xs, w[:, None])), bs.astype(xs.dtype), acc)


def scale_by(t, w):
    """t times w (float32, broadcastable to t), in t's dtype. bfloat16 tiles are scaled in bfloat16 (w rounded to
    it, then one packed multiply per two elements, HMUL2; bfloat16 has float32's range); other dtypes are widened
    to float32 and rounded back, since float16 could underflow small weights."""
    if t.dtype == ct.bfloat16:
        return t * w.astype(ct.bfloat16)
    return (t.astype(ct.float32) * w).astype(t.dtype)
