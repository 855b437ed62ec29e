"""What each launch specialises on: every kernel's compile-time constants, its ct.kernel hints (the occupancy
tables) and the rules that pick them from sizes and dtypes, each with the measurement that set it. specs.py
enumerates the domain of these functions, so that every specialisation a launcher can take is compiled ahead of
time (tests/test_kernels_compile.py).
"""

from __future__ import annotations

import functools

from . import config, registry, runtime
from .common import (STATE_BLOCKS, STATE_LOAD_LATENCY, STATE_PROGRAMS_PER_SM, TILE_H, TILE_N, TILE_P, cdiv,
                     segment_tiles, sub_block)


def chunk_cumsum_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BH=TILE_H)


# chunk_state's dstate tile: 128 (x read once per 128 state columns) took 0.167 -> 0.133 ms at T=16K N=128 and
# 1.234 -> 0.979 at T=64K N=256 (measure/variants_scan.py, H200; with the weights on x, chunk_state.py).
CHUNK_STATE_TN = 128


# ... and where dstate fits in 64 (half of a 128-wide tile would be padding, in B's loads and the products): on
# the H200 (variants_scan "state TN64", bfloat16, chunk 256) chunk_state 0.081 -> 0.073 ms at T=16K N=64 and
# 0.299 -> 0.263 at T=64K N=64, the call 1.324 -> 1.285 ms; at N >= 128 the 64-wide tile was 1.5x slower.
CHUNK_STATE_SMALL_TN = 64


def chunk_state_tn(dstate: int) -> int:
    """chunk_state's dstate tile for this dstate."""
    return CHUNK_STATE_SMALL_TN if dstate <= CHUNK_STATE_SMALL_TN else CHUNK_STATE_TN


# chunk_state's heads per program (HB) and its occupancy hint at HB > 1, per (input dtype, chunk size): two
# heads share each B tile. On the H200 at chunk 256, bfloat16 (measure/variants_scan.py "state HB2 occ 2"
# against the defaults, 4abd1b3): chunk_state 0.134 -> 0.129 ms at T=16K N=128, 0.260 -> 0.246 at N=256,
# 0.522 -> 0.463 at N=512; with 64-wide dstate tiles instead it was 2x slower.
CHUNK_STATE_HEADS = {("bfloat16", 256): (2, 2)}


# Up to this dstate (one 64-wide dstate tile) chunk_state takes one head per program whatever CHUNK_STATE_HEADS
# says: sharing B's (L, 64) tile saves little, and twice the programs fill the SMs better. On the H200
# (variants_scan / graph_scan "state HB1", docs/history.md v36): eager 4K 0.090 -> 0.087 ms, 16K 0.282 ->
# 0.277, 64K 1.049 -> 1.026; 1K under graphs 38.7 -> 35.5 us. At dstate 128 two heads stay ahead (4K 0.110 against
# 0.114, 16K 0.370 against 0.396).
CHUNK_STATE_ONE_HEAD_MAX_DSTATE = 64


def table_heads(dtype: str, chunk_size: int) -> int:
    """HB from CHUNK_STATE_HEADS (1 where it has no entry): what specs.py builds besides one head."""
    return CHUNK_STATE_HEADS.get((dtype, chunk_size), (1, None))[0]


def chunk_state_heads(dtype: str, chunk_size: int, dstate: int) -> int:
    """HB of a launch: config.current().chunk_state_heads where set, else the table's (1 at dstate <=
    CHUNK_STATE_ONE_HEAD_MAX_DSTATE); the launch takes it where it fits (heads_per_program)."""
    forced = config.current().chunk_state_heads
    if forced is not None:
        return forced
    return 1 if dstate <= CHUNK_STATE_ONE_HEAD_MAX_DSTATE else table_heads(dtype, chunk_size)


def heads_per_program(hb: int, heads_per_group: int) -> int:
    """hb where it divides the heads of a group (a program's heads share one group's B), else 1: the rule of
    chunk_state's launches."""
    return hb if heads_per_group % hb == 0 else 1


def chunk_state_constants(chunk_size: int, has_seq: bool, check: bool = True, heads: int = 1,
                          tn: int = CHUNK_STATE_TN) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=tn, HAS_SEQ=bool(has_seq),
                CHK=bool(check), HB=heads)


def chunk_state_hints(dtype: str, chunk_size: int, heads: int) -> dict:
    """ct.kernel hints of chunk_state with `heads` heads per program (the table's for one head)."""
    occ = CHUNK_STATE_HEADS.get((dtype, chunk_size), (1, None))[1]
    if heads > 1 and occ is not None:
        return {"occupancy": occ}
    return kernel_hints("chunk_state", dtype, chunk_size)


def tiles_in_bounds(seqlen: int, headdim: int, dstate: int, k: dict) -> bool:
    """Whether every (row block, headdim tile, dstate tile) of a chunk_state or compute_out launch with
    constants k (BL, TP, TN) lies inside the arrays, so that its loads can skip bounds checks (CHK=False)."""
    return seqlen % k["BL"] == 0 and headdim % k["TP"] == 0 and dstate % k["TN"] == 0


def bounds_checked(k: dict, seqlen: int, headdim: int, dstate: int) -> dict:
    """k with CHK set for these sizes (tiles_in_bounds)."""
    return {**k, "CHK": not tiles_in_bounds(seqlen, headdim, dstate, k)}


def state_passing_constants(block: int, has_seq: bool, separate: bool = False, check: bool = True) -> dict:
    """check: bounds-checked, zero-padded loads of the local states; state_passing_checks says when they are
    needed."""
    return dict(BLK=block, HAS_SEQ=bool(has_seq), LAT=STATE_LOAD_LATENCY, SEP=bool(separate), CHK=bool(check))


def state_passing_checks(block: int, state_elems: int) -> bool:
    """Whether state_passing's blocks of `block` elements need bounds checks: the last block of a head's state
    is partial."""
    return state_elems % block != 0


# state_passing's block in the forward: the smallest of STATE_BLOCKS. Since v25 (loads carried raw through the
# walk) it was the fastest block, or within noise of it, at every shape measured on an H200 (B=1, H=80, P=64,
# bf16, chunk 256, measure/variants_scan.py and graph_scan.py "sp blk<n>": T=1K-64K, dstate 64-512), e.g.
# the call at T=16K N=128 0.394 ms against 0.405 with the older rule's 1024 and 0.411 with 2048, at T=64K
# N=128 1.492 against 1.533; 256 was slower everywhere (0.409, 1.549).
FORWARD_STATE_BLOCK = 512


def forward_state_block() -> int:
    """The forward state_passing's block of state elements per program (FORWARD_STATE_BLOCK, or the config's)."""
    forced = config.current().state_block
    return forced if forced is not None else FORWARD_STATE_BLOCK


def backward_walk_block(batch: int, nheads: int, state_elems: int, device) -> int:
    """The backward walk's block (state_passing_bwd): the largest of STATE_BLOCKS that gives at least
    STATE_PROGRAMS_PER_SM programs per SM (the smallest block when none does): bigger blocks mean fewer, longer
    loads per program, smaller ones more programs to hide each chunk's load latency behind. 1024 at B=1,
    H=80, P=64, N=128 on 132 SMs (640 programs); 2048 at N=256."""
    forced = config.current().state_block
    if forced is not None:
        return forced
    sms = runtime.sm_count(device)
    for blk in sorted(STATE_BLOCKS, reverse=True):
        if batch * nheads * cdiv(state_elems, blk) >= STATE_PROGRAMS_PER_SM * sms:
            return blk
    return min(STATE_BLOCKS)


def chunk_cb_constants(chunk_size: int, block: int | None = None, diag: bool = False) -> dict:
    """block: the (block x block) tiles of C . B^T, compute_out's row block (default sub_block(chunk_size));
    diag: the diagonal blocks only (compute_out_carry's)."""
    return dict(L=chunk_size, BL=block or sub_block(chunk_size), TN=TILE_N, DIAG=bool(diag))


# Compiler hints (ct.kernel occupancy = CTAs per SM the register allocation aims for) per (kernel, input
# dtype class, chunk size). First chosen from tileiras 13.4's sm_90 resource report (compute_out bf16 L=64:
# 201 -> 168 registers, 2 -> 3 CTAs; chunk_state bf16 L=256: 254 -> 168), then set from timings on an H200
# (measure/op_times.py, B=1 H=80 P=64 bf16, op ms without -> with the hint):
#   compute_out L=128: 1.168 -> 0.617 (T=16K N=128), 4.863 -> 2.914 (T=64K N=256), despite small spills
#   compute_out L=256: 1.131 -> 0.733, 5.228 -> 3.378;  L=64: 1.234 -> 0.697, 5.488 -> 3.309
#   chunk_state L=64 (whole state pass): 1.083 -> 0.903, 7.645 -> 6.877;  L=256: 0.494 -> 0.460
# float32 kernels have no entry (the cap spills kilobytes per thread; untimed).
# Not searched through autotune.py: each candidate hint is a separate compile (seconds each, too slow for a
# first call), and state_passing runs in place, so a timed candidate would overwrite its own input.
_OCCUPANCY = {
    # bfloat16 at chunk 256 with the bf16 state product (compute_out_constants SBF): 0.562 -> 0.522 ms with
    # 4 instead of 3 (T=16K N=128), 2.807 -> 2.637 (T=64K N=256). Entries by dtype override the class's.
    ("compute_out", "bfloat16", 256): 4,
    ("compute_out", "16bit", 32): 3,
    ("compute_out", "16bit", 64): 3,
    ("compute_out", "16bit", 128): 3,
    ("compute_out", "16bit", 256): 3,
    ("chunk_state", "16bit", 64): 3,
    ("chunk_state", "16bit", 128): 3,
    # bfloat16 at chunk 256: 4 instead of 3 gave 0.292 -> 0.275 ms (T=16K N=128) and 2.22 -> 2.13 (T=64K N=256) in
    # two runs on two days (measure/variants_scan.py "index32 state occ 4", "state BL128 occ 4").
    ("chunk_state", "bfloat16", 256): 4,
    ("chunk_state", "16bit", 256): 3,
    # Backward kernels at their 64-token block (chunk sizes 64-256), bfloat16 (bfloat16 products, LOWP), from
    # one sweep of occupancy 2/3/4 against none (measure/backward_scan.py --occupancy 2,3,4, B=1 H=80 P=64
    # N=128 chunk 256, kernel ms at T=16K / 64K, none -> chosen): out_bwd_dx 0.876 -> 0.448 / 3.49 -> 1.76 (3);
    # out_bwd_dcbw 0.903 -> 0.653 / 3.45 -> 2.14 (2); out_bwd_dcdb 0.653 -> 0.335 / 2.56 -> 1.28 (2);
    # out_bwd_dstates 0.301 -> 0.129 / 1.19 -> 0.50 (4); chunk_state_bwd_x 0.462 -> 0.203 / 1.82 -> 0.75 (4);
    # chunk_state_bwd_b 0.439 -> 0.249 / 1.72 -> 0.97 (4).
    # out_bwd_dx at 4 since v11 moved its row scale onto C.B^T: 1.302 -> 1.185 ms at T=64K N=128 (3 -> 4; 2: 1.643),
    # and chunk_state_bwd_x kept at 4 once it stopped spilling (0.879; 3: 0.876, 2: 1.040), in one sweep of
    # measure/backward_scan.py --shapes 64K:128 --occupancy 2,3,4 (the other choices unchanged by it).
    # out_bwd_dx back at 3 since v13 added dt's gradient and dA_cumsum's column sums to it (more registers):
    # 0.457 -> 0.392 ms at T=16K and 1.811 -> 1.543 at T=64K (4 -> 3; 2: 0.488 / 1.933), same sweep at 7e74629.
    # Since 7f297af the column sums are out_bwd_dcbw's (accuracy): neither kernel's occupancy swept again yet.
    ("out_bwd_dx", "bfloat16", 64): 3,
    ("out_bwd_dcbw", "bfloat16", 64): 2,
    ("out_bwd_dcdb", "bfloat16", 64): 2,
    ("out_bwd_dstates", "bfloat16", 64): 4,
    ("chunk_state_bwd_x", "bfloat16", 64): 4,
    ("chunk_state_bwd_b", "bfloat16", 64): 4,
}


# Hints at every chunk size, per (kernel, dtype class). Without a hint tileiras builds these at 255 registers and
# 256 threads, one CTA per SM (docs/history.md, "Kernels built without an occupancy hint"). From one sweep
# on an H200 (B=1 H=80 P=64 bf16, chunk 256; measure/variants_scan.py, backward_scan.py, decode_scan.py;
# kernel ms at T=64K, none -> chosen, other hints in parentheses):
#   chunk_cb 0.154 -> 0.125 (N=64; occ 2: 0.135): the forward call 1.257 -> 1.229 ms (N=64), 1.506 -> 1.476 (N=128).
#     float32 activations keep none: their build spills about 2,000 words a thread at occupancy 4.
#   state_passing_bwd, the walk with gcarry: 0.616 -> 0.325 (N=128; occ 4: 0.415)
#   state_carry_grad 0.280 -> 0.099 (N=64; occ 8: 0.182);  chunk_cumsum_bwd 0.095 -> 0.073 (occ 8 is ignored)
# Forward plus backward, these hints against none (a second run): 7.922 -> 7.550 ms (64K/N=128), 2.188 -> 2.097
# (16K/N=128), 6.448 -> 6.199 (64K/N=64).
# Some of these builds spill a little (chunk_cumsum_bwd at chunk 256 about 115 words a thread): faster all the
# same. chunk_cumsum (occ 4: 0.033 -> 0.038 ms; occ 8 slower still) and varlen_states (not swept) keep none.
# state_update at occupancy 2 (the table's, for rows that are not 16-byte multiples): 1.200 -> 0.675 ms per decode
# step at batch 256 N=128, 2.511 -> 1.419 at N=256 (decode_scan.py), every GPU suite passing. Occupancy 4 and 8 gave
# wrong outputs at headdim 50, dstate 100 with a bfloat16 state (values of order 1e35 at 4, rows left unwritten at
# 8): the only builds seen to both spill and make no TMA copy (measure/state_update_builds.py; docs/history.md
# v26, v28). At that shape occupancy 2 compiles to the unhinted build, so its evidence is the
# suites at the other shapes, where it halves the registers (255 -> 128) without spilling. Where every tiled
# array has 16-byte rows the launcher takes occupancy 4 instead (STATE_UPDATE_ALIGNED_OCCUPANCY, below).
# The backward's kernels are keyed by "float32" whatever the activations (they read float32).
_OCCUPANCY_ANY_CHUNK = {
    ("chunk_cb", "16bit"): 4,
    ("state_passing_bwd", "float32"): 8,
    ("state_carry_grad", "float32"): 4,
    ("chunk_cumsum_bwd", "float32"): 4,
    ("state_update", "16bit"): 2,
    ("state_update", "float32"): 2,
    # the in-place kernel (state_update_inplace.py) is state_update with its state read and written in one array
    ("state_update_inplace", "16bit"): 2,
    ("state_update_inplace", "float32"): 2,
    # The causal convolution (conv.py): the 16-bit forward swept on an H200 (conv.py's tile comment); the others
    # chosen from ptxas -v of builds that lacked the run-time facts launches are specialised on, not swept. The
    # backward at occupancy 1 measured slower (1.38 against 0.91 ms).
    ("causal_conv1d", "16bit"): 8,
    ("causal_conv1d", "float32"): 3,
    ("causal_conv1d_bwd", "16bit"): 2,
    ("causal_conv1d_bwd", "float32"): 2,
    ("causal_conv1d_update", "16bit"): 4,
    ("causal_conv1d_update", "float32"): 4,
}


# Intermediates in bfloat16 for bfloat16 activations (the recurrence and the final state stay float32):
# - C . B^T (cb_dtype_name): half of compute_out's largest read, 10 of the ~29 tiles a (chunk, head) reads at chunk
#   256; the product is rounded to bfloat16 before its product with x, as x itself is;
# - chunk_scan's entering states, written by state_passing to their own array for compute_out's bfloat16 state
#   product (entering_dtype_names, compute_out_constants' SBF): half the bytes of those writes and reads. With the
#   first, on the H200 (32-bit-indexed kernels, chunk 256): compute_out 0.540 -> 0.283 ms and the call 1.19 -> 0.93
#   ms at T=16K N=128, compute_out 2.73 -> 1.35 ms and the call 6.12 -> 4.69 ms at T=64K N=256; y moved by 1.8e-3
#   relative (bfloat16's rounding);
# - there, at chunk LOCAL_STATES_CHUNK, the chunks' local states too (local_dtype_names): half of chunk_state's
#   largest write and state_passing's read, one more bfloat16 rounding per local state. On the H200 (T=16K, call
#   ms): N=64 0.443 -> 0.424, N=128 0.526 -> 0.487, N=512 1.220 -> 1.073; y's error unchanged (1.7e-3-1.9e-3).
LOCAL_STATES_CHUNK = 256


def local_dtype_names(dtype: str, chunk_size: int) -> tuple:
    """The dtypes chunk_state can store the local states in for activations of dtype at chunk_size: float32,
    and bfloat16 where the entering states are bfloat16 at LOCAL_STATES_CHUNK."""
    extra = dtype == "bfloat16" and chunk_size == LOCAL_STATES_CHUNK
    return ("float32", "bfloat16") if extra else ("float32",)


def cb_dtype_name(dtype: str) -> str:
    """dtype of chunk_cb's C . B^T (compute_out's input) for activations of dtype (forward)."""
    return "bfloat16" if dtype == "bfloat16" else "float32"


def entering_dtype_names(dtype: str) -> tuple:
    """The dtypes of the entering states compute_out can read for activations of dtype: float32 (the
    fwd_pass_state op's output) and, for bfloat16 activations in chunk_scan's two-op path, bfloat16."""
    return ("float32", "bfloat16") if dtype == "bfloat16" else ("float32",)


def kernel_hints(kernel_name: str, dtype: str, chunk_size: int) -> dict:
    """The ct.kernel hints the launcher uses for a kernel at an input dtype ("float16", "bfloat16",
    "float32") and chunk size: {} or {"occupancy": k}."""
    dclass = "16bit" if dtype in ("float16", "bfloat16") else dtype
    occ = _OCCUPANCY.get((kernel_name, dtype, chunk_size), _OCCUPANCY.get((kernel_name, dclass, chunk_size),
                                                                        _OCCUPANCY_ANY_CHUNK.get((kernel_name, dclass))))
    return {} if occ is None else {"occupancy": occ}


@functools.lru_cache(maxsize=None)
def hinted(kernel_name: str, hints: tuple):
    """The kernel object compiled with hints (one object, hence one JIT cache, per distinct hints)."""
    k = registry.KERNELS[kernel_name]
    return k.replace_hints(**dict(hints)) if hints else k


@functools.lru_cache(maxsize=None)
def hinted_kernel(kernel_name: str, dtype: str, chunk_size: int):
    """The kernel object a launcher launches, with the table's hints (kept per key: launchers outside a plan, e.g.
    the decode step and the backward's, call this on every call)."""
    return hinted(kernel_name, tuple(sorted(kernel_hints(kernel_name, dtype, chunk_size).items())))


def varlen_states_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N)


def compute_out_constants(chunk_size: int, has_seq: bool, check: bool = True, dtype: str = "float32") -> dict:
    """SBF: the inter-chunk product C . S^T in bfloat16 (states rounded from float32) for bfloat16 inputs,
    whose range is float32's; float16 (overflow) and float32 keep the tf32 product. Measured on an H200
    (measure/variants_scan.py, T=16K N=128 / T=64K N=256, chunk 256): compute_out 0.598 -> 0.522 and
    3.053 -> 2.637 ms together with occupancy 4; y moved by 2e-4 relative."""
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq),
                CHK=bool(check), SBF=dtype == "bfloat16")


def segment_constants(dstate: int, has_seq: bool) -> dict:
    BL, TP, NT = segment_tiles(dstate)
    return dict(BL=BL, TP=TP, NT=NT, HAS_SEQ=bool(has_seq))


FUSED_CUMSUM_CHUNKS = (256,)


def fused_cumsum_can_run(chunk_size: int, heads: int) -> bool:
    """Whether chunk_state_cumsum_cb_kernel is built for this chunk size and heads per program (HB heads must lie
    in one of chunk_cumsum's blocks of TILE_H)."""
    return chunk_size in FUSED_CUMSUM_CHUNKS and TILE_H % heads == 0


def fused_cumsum_constants(chunk_size: int, check: bool, heads: int, tn: int) -> dict:
    """chunk_state_cumsum_cb_kernel's constants: chunk_state's without HAS_SEQ (it has no seq_idx)."""
    k = chunk_state_constants(chunk_size, False, check, heads, tn)
    k.pop("HAS_SEQ")
    return k


# The largest dstate compute_out_carry holds in one state tile, and the tiles (dstate rounded up) it is built for.
# At dstate 256 and 512 (a (64, 256-512) float32 state, or headdim tiles of 32) it was 1.3-2x slower than the walk
# on the H200 (docs/history.md v34).
OUT_CARRY_MAX_DSTATE = 128


OUT_CARRY_TILES = (16, 32, 64, 128)


# Above dstate 64 (the 128-wide state tile, occupancy 2) the carry takes over from this many tokens: at 1K tokens
# its 320 programs (B=1, H=80) are 1.2 waves and the call was 45.6 -> 48.7 us under CUDA graphs, at 4K 0.119 ->
# 0.112 ms. At dstate <= 64 it was faster at every length measured, 1K (40.6 -> 38.4 us) to 256K.
OUT_CARRY_WIDE_SEQLEN = 4096


def out_carry_can_run(dstate: int, chunk_size: int) -> bool:
    """Whether compute_out_carry is built for this dstate and chunk size (chunks of more than one row block)."""
    return dstate <= OUT_CARRY_MAX_DSTATE and chunk_size > sub_block(chunk_size)


def out_carry_applies(dstate: int, chunk_size: int, seqlen: int) -> bool:
    """Whether the forward's output kernel is compute_out_carry (else compute_out's column walk)."""
    if not out_carry_can_run(dstate, chunk_size):
        return False
    forced = config.current().out_carry
    if forced is not None:
        return bool(forced)
    return dstate <= 64 or seqlen >= OUT_CARRY_WIDE_SEQLEN


# compute_out_carry's occupancy hint by its state tile (TN), 16-bit inputs: its registers grow with the (TP, TN)
# float32 state it carries. On the H200 (measure/variants_scan.py "out carry occ k", bfloat16, chunk 256,
# compute_out_carry ms): TN 64 at 64K 1.141 / 0.714 / 0.648 / 1.198 at occupancy 1 / 2 / 3 / 4; TN 128 at 64K
# 1.305 / 0.878 / 1.318 / 1.317. float32 inputs take 2 (not measured).
OUT_CARRY_OCCUPANCY = {16: 3, 32: 3, 64: 3, 128: 2}


def out_carry_hints(dtype: str, tn: int) -> dict:
    return {"occupancy": OUT_CARRY_OCCUPANCY[tn] if dtype in ("float16", "bfloat16") else 2}


def out_carry_constants(chunk_size: int, dstate: int, has_seq: bool, dtype: str) -> dict:
    k = compute_out_constants(chunk_size, has_seq, dtype=dtype)
    k["TN"] = max(16, 1 << (dstate - 1).bit_length())
    return k
