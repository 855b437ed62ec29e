"""Launchers of the forward kernels: each picks the specialisation, allocates the outputs, computes the grid
and the arguments, and launches on the current stream. No host synchronisation and no branching on tensor
values, so they run under CUDA-graph capture and inside torch.compile graphs.

What runs the reference instead (same results, slower):
- float64 inputs (x, B, C, dt or the float32 intermediates given as float64): the reference computes in
  float64, which the kernels do not;
- chunk sizes other than 16, 32, 64, 128, 256.

state_update (the one-token decode op) is at the end.

Inputs are read in place through their strides (any layout, no padding copies), with these exceptions, each
one copy of a small or rare tensor:
- A, dt_bias, D and initial_states are converted to float32 when they are not (the backward also expands a
  per-head D to (nheads, headdim)); seq_idx and cu_seqlens to int32 when they are int64;
- when x, B, C (and z) differ in dtype, they are converted to their promoted dtype and y is converted back;
- a tensor with a zero stride over a dimension longer than one (an expanded view) is made contiguous,
  because the kernels assume distinct indices address distinct elements.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import cuda.tile as ct

from .. import envvars
from ..meta.shapes import cb_shape, cumsum_shape, final_states_shape, num_chunks, states_shape, varlen_states_shape
from ..reference import chunked as ref
from ..reference import state_update as ref_su
from . import autotune, index_width
from .chunk_cb import chunk_cb_kernel
from .chunk_cumsum import chunk_cumsum_kernel
from .chunk_state import (chunk_state_cb_kernel, chunk_state_cumsum_cb_kernel, chunk_state_kernel,
                          chunk_state_pass_kernel)
from .common import (SEGMENT_BL, SEGMENT_MAX_DSTATE, SEGMENT_MAX_WALK, SEGMENT_PROGRAMS_PER_SM, STATE_BLOCKS,
                     STATE_LOAD_LATENCY,
                     STATE_PROGRAMS_PER_SM, TILE_H, TILE_N, TILE_P, cdiv, segment_tiles, sub_block,
                     supported_chunk_size)
from .compute_out import compute_out_kernel
from .compute_out_carry import compute_out_carry_kernel
from .compute_out_bwd import out_bwd_dcbw_kernel, out_bwd_dcdb_kernel, out_bwd_dstates_kernel, out_bwd_dx_kernel
from .segments import segment_out_kernel, segment_state_kernel
from .chunk_cumsum_bwd import chunk_cumsum_bwd_kernel
from .state_pass_bwd import (chunk_state_bwd_b_kernel, chunk_state_bwd_x_kernel, state_carry_grad_kernel,
                             state_passing_bwd_kernel)
from .state_passing import state_passing_kernel
from .state_update import state_update_kernel
from .varlen_states import varlen_states_kernel

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- specialisation choices (specs.py enumerates the domain of these functions) ----

def chunk_cumsum_constants(chunk_size: int) -> dict:
    k = dict(L=chunk_size, BH=TILE_H)
    k.update(CONSTANT_OVERRIDE.get("chunk_cumsum", {}))
    return k


# chunk_state's dstate tile: 128 (x read once per 128 state columns) took 0.167 -> 0.133 ms at T=16K N=128 and
# 1.234 -> 0.979 at T=64K N=256 (tests/gpu/variants_scan.py, H200; with the weights on x, chunk_state.py).
CHUNK_STATE_TN = 128
# ... and where dstate fits in 64 (half of a 128-wide tile would be padding, in B's loads and the products): on
# the H200 (variants_scan "state TN64", bfloat16, chunk 256) chunk_state 0.081 -> 0.073 ms at T=16K N=64 and
# 0.299 -> 0.263 at T=64K N=64, the call 1.324 -> 1.285 ms; at N >= 128 the 64-wide tile was 1.5x slower.
CHUNK_STATE_SMALL_TN = 64


def chunk_state_tn(dstate: int) -> int:
    """chunk_state's dstate tile for this dstate."""
    return CHUNK_STATE_SMALL_TN if dstate <= CHUNK_STATE_SMALL_TN else CHUNK_STATE_TN


# chunk_state's heads per program (HB) and its occupancy hint at HB > 1, per (input dtype, chunk size): two
# heads share each B tile. On the H200 at chunk 256, bfloat16 (tests/gpu/variants_scan.py "state HB2 occ 2"
# against the defaults, 4abd1b3): chunk_state 0.134 -> 0.129 ms at T=16K N=128, 0.260 -> 0.246 at N=256,
# 0.522 -> 0.463 at N=512; with 64-wide dstate tiles instead it was 2x slower.
CHUNK_STATE_HEADS = {("bfloat16", 256): (2, 2)}


# Up to this dstate (one 64-wide dstate tile) chunk_state takes one head per program whatever CHUNK_STATE_HEADS
# says: sharing B's (L, 64) tile saves little, and twice the programs fill the SMs better. On the H200
# (variants_scan / graph_scan "state HB1", docs/performance-log.md v36): eager 4K 0.090 -> 0.087 ms, 16K 0.282 ->
# 0.277, 64K 1.049 -> 1.026; 1K under graphs 38.7 -> 35.5 us. At dstate 128 two heads stay ahead (4K 0.110 against
# 0.114, 16K 0.370 against 0.396).
CHUNK_STATE_ONE_HEAD_MAX_DSTATE = 64


def chunk_state_heads(dtype: str, chunk_size: int, dstate: int | None = None) -> int:
    """HB from CHUNK_STATE_HEADS (1 where it has no entry, or at dstate <= CHUNK_STATE_ONE_HEAD_MAX_DSTATE; without
    dstate, the table's choice, which specs.py builds); a launch takes it where it fits (heads_per_program)."""
    if dstate is not None and dstate <= CHUNK_STATE_ONE_HEAD_MAX_DSTATE:
        return 1
    return CHUNK_STATE_HEADS.get((dtype, chunk_size), (1, None))[0]


def heads_per_program(hb: int, heads_per_group: int) -> int:
    """hb where it divides the heads of a group (a program's heads share one group's B), else 1: the rule of
    chunk_state's launches."""
    return hb if heads_per_group % hb == 0 else 1


def chunk_state_constants(chunk_size: int, has_seq: bool, check: bool = True, heads: int = 1,
                          tn: int = CHUNK_STATE_TN) -> dict:
    k = dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=tn, HAS_SEQ=bool(has_seq),
             CHK=bool(check), HB=heads)
    k.update(CONSTANT_OVERRIDE.get("chunk_state", {}))
    return k


def chunk_state_hints(dtype: str, chunk_size: int, heads: int) -> dict:
    """ct.kernel hints of chunk_state with `heads` heads per program (the table's for one head)."""
    occ = CHUNK_STATE_HEADS.get((dtype, chunk_size), (1, None))[1]
    if heads > 1 and occ is not None and "chunk_state" not in HINT_OVERRIDE:
        return {"occupancy": occ}
    return kernel_hints("chunk_state", dtype, chunk_size)


def tiles_in_bounds(seqlen: int, headdim: int, dstate: int, k: dict) -> bool:
    """Whether every (row block, headdim tile, dstate tile) of a chunk_state or compute_out launch with
    constants k (BL, TP, TN) lies inside the arrays, so that its loads can skip bounds checks (CHK=False)."""
    return seqlen % k["BL"] == 0 and headdim % k["TP"] == 0 and dstate % k["TN"] == 0


def _bounds_checked(kernel_name: str, k: dict, seqlen: int, headdim: int, dstate: int) -> dict:
    """k with CHK set for these sizes (tiles_in_bounds), unless CONSTANT_OVERRIDE fixes CHK."""
    if "CHK" in CONSTANT_OVERRIDE.get(kernel_name, {}):
        return k
    return {**k, "CHK": not tiles_in_bounds(seqlen, headdim, dstate, k)}


def state_passing_constants(block: int, has_seq: bool, separate: bool = False, check: bool = True) -> dict:
    """check: bounds-checked, zero-padded loads of the local states; state_passing_checks says when they are
    needed."""
    k = dict(BLK=block, HAS_SEQ=bool(has_seq), LAT=STATE_LOAD_LATENCY, SEP=bool(separate), CHK=bool(check))
    k.update(CONSTANT_OVERRIDE.get("state_passing", {}))
    return k


def state_passing_checks(block: int, state_elems: int) -> bool:
    """Whether state_passing's blocks of `block` elements need bounds checks: the last block of a head's state
    is partial."""
    return state_elems % block != 0


# None: the launchers' choice (forward_state_block, backward_walk_block); an element of STATE_BLOCKS: that block
# (tests/gpu/check_kernels.py --profile and tests/gpu/variants_scan.py sweep it).
STATE_BLOCK_OVERRIDE = None
# state_passing's block in the forward: the smallest of STATE_BLOCKS. Since v25 (loads carried raw through the
# walk) it was the fastest block, or within noise of it, at every shape measured on an H200 (B=1, H=80, P=64,
# bf16, chunk 256, tests/gpu/variants_scan.py and graph_scan.py "sp blk<n>": T=1K-64K, dstate 64-512), e.g.
# the call at T=16K N=128 0.394 ms against 0.405 with the older rule's 1024 and 0.411 with 2048, at T=64K
# N=128 1.492 against 1.533; 256 was slower everywhere (0.409, 1.549).
FORWARD_STATE_BLOCK = 512


def forward_state_block() -> int:
    """The forward state_passing's block of state elements per program (FORWARD_STATE_BLOCK, or the override)."""
    return STATE_BLOCK_OVERRIDE if STATE_BLOCK_OVERRIDE is not None else FORWARD_STATE_BLOCK


def backward_walk_block(batch: int, nheads: int, state_elems: int, device) -> int:
    """The backward walk's block (state_passing_bwd): the largest of STATE_BLOCKS that gives at least
    STATE_PROGRAMS_PER_SM programs per SM (the smallest block when none does): bigger blocks mean fewer, longer
    loads per program, smaller ones more programs to hide each chunk's load latency behind. 1024 at B=1,
    H=80, P=64, N=128 on 132 SMs (640 programs); 2048 at N=256."""
    if STATE_BLOCK_OVERRIDE is not None:
        return STATE_BLOCK_OVERRIDE
    sms = _sm_count(device)
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
# (tests/gpu/check_kernels.py --profile, B=1 H=80 P=64 bf16, op ms without -> with the hint):
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
    # two runs on two days (tests/gpu/variants_scan.py "index32 state occ 4", "state BL128 occ 4").
    ("chunk_state", "bfloat16", 256): 4,
    ("chunk_state", "16bit", 256): 3,
    # Backward kernels at their 64-token block (chunk sizes 64-256), bfloat16 (bfloat16 products, LOWP), from
    # one sweep of occupancy 2/3/4 against none (tests/gpu/backward_scan.py --occupancy 2,3,4, B=1 H=80 P=64
    # N=128 chunk 256, kernel ms at T=16K / 64K, none -> chosen): out_bwd_dx 0.876 -> 0.448 / 3.49 -> 1.76 (3);
    # out_bwd_dcbw 0.903 -> 0.653 / 3.45 -> 2.14 (2); out_bwd_dcdb 0.653 -> 0.335 / 2.56 -> 1.28 (2);
    # out_bwd_dstates 0.301 -> 0.129 / 1.19 -> 0.50 (4); chunk_state_bwd_x 0.462 -> 0.203 / 1.82 -> 0.75 (4);
    # chunk_state_bwd_b 0.439 -> 0.249 / 1.72 -> 0.97 (4).
    # out_bwd_dx at 4 since v11 moved its row scale onto C.B^T: 1.302 -> 1.185 ms at T=64K N=128 (3 -> 4; 2: 1.643),
    # and chunk_state_bwd_x kept at 4 once it stopped spilling (0.879; 3: 0.876, 2: 1.040), in one sweep of
    # tests/gpu/backward_scan.py --shapes 64K:128 --occupancy 2,3,4 (the other choices unchanged by it).
    # out_bwd_dx back at 3 since v13 added dt's gradient and dA_cumsum's column sums to it (more registers):
    # 0.457 -> 0.392 ms at T=16K and 1.811 -> 1.543 at T=64K (4 -> 3; 2: 0.488 / 1.933), same sweep at 7e74629.
    ("out_bwd_dx", "bfloat16", 64): 3,
    ("out_bwd_dcbw", "bfloat16", 64): 2,
    ("out_bwd_dcdb", "bfloat16", 64): 2,
    ("out_bwd_dstates", "bfloat16", 64): 4,
    ("chunk_state_bwd_x", "bfloat16", 64): 4,
    ("chunk_state_bwd_b", "bfloat16", 64): 4,
}
# Hints at every chunk size, per (kernel, dtype class). Without a hint tileiras builds these at 255 registers and
# 256 threads, one CTA per SM (docs/performance-log.md, "Kernels built without an occupancy hint"). From one sweep
# on an H200 (B=1 H=80 P=64 bf16, chunk 256; tests/gpu/variants_scan.py, backward_scan.py, decode_scan.py;
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
# 8): the only builds seen to both spill and make no TMA copy (tests/state_update_builds.py; docs/
# performance-log.md v26, v28). At that shape occupancy 2 compiles to the unhinted build, so its evidence is the
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
}
# kernel name -> hints dict that replaces the table's choice (profiling sweeps); empty in normal use.
HINT_OVERRIDE: dict = {}
# kernel name -> constants that replace the launcher's (profiling experiments); empty in normal use.
CONSTANT_OVERRIDE: dict = {}
# C . B^T stored in bfloat16 for bfloat16 inputs (half of compute_out's largest read, 10 of the ~29 tiles a
# (chunk, head) reads at chunk 256; the product is rounded to bfloat16 before its product with x, as x itself
# is). chunk_scan's entering states written in bfloat16 by state_passing for compute_out's bfloat16 state
# product (SBF): half the bytes of state_passing's writes and compute_out's state reads; the recurrence and the
# final state stay float32. Together, on the H200 with the 32-bit-indexed kernels (tests/gpu/variants_scan.py,
# chunk 256): compute_out 0.540 -> 0.283 ms and the call 1.19 -> 0.93 ms at T=16K N=128, compute_out 2.73 ->
# 1.35 ms and the call 6.12 -> 4.69 ms at T=64K N=256; y moved by 1.8e-3 relative (bfloat16's rounding).
CB_IN_BF16 = True
STATES_IN_BF16 = True
# Where state_passing writes the entering states to their own bfloat16 array (STATES_IN_BF16, bfloat16
# activations) at chunk 256, chunk_state also stores the chunks' local states in bfloat16, halving the largest
# write of chunk_state and read of state_passing (the recurrence and the final state stay float32; each local
# state gains one bfloat16 rounding, like the products that formed it). Measured on an H200
# (tests/gpu/variants_scan.py "local states bf16", T=16K, call ms): N=64 0.443 -> 0.424, N=128 0.526 -> 0.487,
# N=512 1.220 -> 1.073; y's error unchanged (1.7e-3-1.9e-3), the final state's 1.7e-3 against the float32 path.
LOCAL_STATES_IN_BF16 = True
LOCAL_STATES_CHUNK = 256


def local_dtype_names(dtype: str, chunk_size: int) -> tuple:
    """The dtypes chunk_state can store the local states in for activations of dtype at chunk_size: float32,
    and bfloat16 where LOCAL_STATES_IN_BF16 may apply (built whether or not it is on)."""
    extra = dtype == "bfloat16" and chunk_size == LOCAL_STATES_CHUNK and "bfloat16" in entering_dtype_names(dtype)
    return ("float32", "bfloat16") if extra else ("float32",)


def cb_dtype_name(dtype: str) -> str:
    """dtype of chunk_cb's C . B^T (compute_out's input) for activations of dtype (forward)."""
    return "bfloat16" if (CB_IN_BF16 and dtype == "bfloat16") else "float32"


def entering_dtype_names(dtype: str) -> tuple:
    """The dtypes of the entering states compute_out can read for activations of dtype: float32 (the
    fwd_pass_state op's output) and, in chunk_scan's two-op path, bfloat16 where STATES_IN_BF16 applies."""
    return ("float32", "bfloat16") if (STATES_IN_BF16 and dtype == "bfloat16") else ("float32",)


def kernel_hints(kernel_name: str, dtype: str, chunk_size: int) -> dict:
    """The ct.kernel hints the launcher uses for a kernel at an input dtype ("float16", "bfloat16",
    "float32") and chunk size: {} or {"occupancy": k}."""
    if kernel_name in HINT_OVERRIDE:
        return dict(HINT_OVERRIDE[kernel_name])
    dclass = "16bit" if dtype in ("float16", "bfloat16") else dtype
    occ = _OCCUPANCY.get((kernel_name, dtype, chunk_size), _OCCUPANCY.get((kernel_name, dclass, chunk_size),
                                                                        _OCCUPANCY_ANY_CHUNK.get((kernel_name, dclass))))
    return {} if occ is None else {"occupancy": occ}


_KERNEL_OBJECTS = {
    "chunk_cumsum": chunk_cumsum_kernel,
    "chunk_state": chunk_state_kernel,
    "chunk_state_cb": chunk_state_cb_kernel,
    "chunk_state_cumsum_cb": chunk_state_cumsum_cb_kernel,
    "chunk_state_pass": chunk_state_pass_kernel,
    "state_passing": state_passing_kernel,
    "varlen_states": varlen_states_kernel,
    "chunk_cb": chunk_cb_kernel,
    "compute_out": compute_out_kernel,
    "compute_out_carry": compute_out_carry_kernel,
    "state_update": state_update_kernel,
    "segment_state": segment_state_kernel,
    "segment_out": segment_out_kernel,
    # Backward kernels (launch_bwd.py) take the chunk size at run time: their hints are keyed by the token
    # block the chunk size implies (common.sub_block) in place of the chunk size.
    "out_bwd_dx": out_bwd_dx_kernel,
    "out_bwd_dcbw": out_bwd_dcbw_kernel,
    "out_bwd_dcdb": out_bwd_dcdb_kernel,
    "out_bwd_dstates": out_bwd_dstates_kernel,
    "chunk_state_bwd_x": chunk_state_bwd_x_kernel,
    "chunk_state_bwd_b": chunk_state_bwd_b_kernel,
    "chunk_cumsum_bwd": chunk_cumsum_bwd_kernel,
    "state_passing_bwd": state_passing_bwd_kernel,
    "state_carry_grad": state_carry_grad_kernel,
}


@functools.lru_cache(maxsize=None)
def _hinted(kernel_name: str, hints: tuple):
    """The kernel object compiled with hints (one object, hence one JIT cache, per distinct hints)."""
    k = _KERNEL_OBJECTS[kernel_name]
    return k.replace_hints(**dict(hints)) if hints else k


def hinted_kernel(kernel_name: str, dtype: str, chunk_size: int):
    """The kernel object a launcher launches: the table's hints, kept per key (launchers outside a plan, e.g.
    the decode step and the backward's, call this on every call), or HINT_OVERRIDE's while it is set."""
    if HINT_OVERRIDE:
        return _hinted_for(kernel_name, dtype, chunk_size)
    return _table_kernel(kernel_name, dtype, chunk_size)


def _hinted_for(kernel_name: str, dtype: str, chunk_size: int):
    return _hinted(kernel_name, tuple(sorted(kernel_hints(kernel_name, dtype, chunk_size).items())))


_table_kernel = functools.lru_cache(maxsize=None)(_hinted_for)


def varlen_states_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N)


def compute_out_constants(chunk_size: int, has_seq: bool, check: bool = True, dtype: str = "float32") -> dict:
    """SBF: the inter-chunk product C . S^T in bfloat16 (states rounded from float32) for bfloat16 inputs,
    whose range is float32's; float16 (overflow) and float32 keep the tf32 product. Measured on an H200
    (tests/gpu/variants_scan.py, T=16K N=128 / T=64K N=256, chunk 256): compute_out 0.598 -> 0.522 and
    3.053 -> 2.637 ms together with occupancy 4; y moved by 2e-4 relative."""
    k = dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq),
             CHK=bool(check), SBF=dtype == "bfloat16")
    k.update(CONSTANT_OVERRIDE.get("compute_out", {}))
    return k


def segment_constants(dstate: int, has_seq: bool) -> dict:
    BL, TP, NT = segment_tiles(dstate)
    return dict(BL=BL, TP=TP, NT=NT, HAS_SEQ=bool(has_seq))


# None: segment_count's choice; an int: that many segments (profiling sweeps).
SEGMENT_COUNT_OVERRIDE = None


def segment_count(batch: int, nheads: int, n_ptiles: int, n_blocks: int, device,
                  programs_per_sm: int | None = None) -> tuple[int, int]:
    """(segments, blocks per segment) of the fused scan: about programs_per_sm (default
    SEGMENT_PROGRAMS_PER_SM) programs per SM, at most one segment per block. More segments mean more parallel
    programs and shorter sequential walks, but more segment states (a few MB) and a longer pass over them."""
    want = SEGMENT_COUNT_OVERRIDE
    if want is None:
        ppsm = SEGMENT_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        want = cdiv(ppsm * _sm_count(device), batch * nheads * n_ptiles)
    nseg = max(1, min(n_blocks, want))
    per_seg = cdiv(n_blocks, nseg)
    return cdiv(n_blocks, per_seg), per_seg


# None: use_segments decides; True / False: always / never the fused scan (profiling and tests).
SEGMENTS_OVERRIDE = None


def segments_can_run(chunk_size: int, dstate: int) -> bool:
    """The fused segment kernels exist for dstate <= 128 and chunks of at least one 64-token block."""
    return dstate <= SEGMENT_MAX_DSTATE and chunk_size >= SEGMENT_BL


def use_segments(chunk_size: int, dstate: int, blocks_per_seg: int) -> bool:
    """Whether chunk_scan runs the fused segment kernels (else the fwd_pass_state and compute_out kernels):
    only where they can (segments_can_run) and were measured faster (short walks; see
    common.SEGMENT_MAX_WALK). SEGMENTS_OVERRIDE forces either where they can."""
    if not segments_can_run(chunk_size, dstate):
        return False
    if SEGMENTS_OVERRIDE is not None:
        return bool(SEGMENTS_OVERRIDE)
    return blocks_per_seg <= SEGMENT_MAX_WALK


# state_update: dstate tiles (dstate rounded up to a power of two, at least 32; dstate above 256 loops over
# 256-wide tiles) and headdim rows per program, TP = STATE_UPDATE_TILE_ELEMS // TN within [8, 64]: 8 KB of
# float32 state per tile, and 4-8 programs per (batch row, head) at headdim 64 for dstate 128-256, so that a
# batch-1 decode step of a large model (80 heads) still runs a few hundred programs.
STATE_UPDATE_TILE_NS = (32, 64, 128, 256)
STATE_UPDATE_TILE_ELEMS = 2048


def state_update_tile_n(dstate: int) -> int:
    for tn in STATE_UPDATE_TILE_NS:
        if dstate <= tn:
            return tn
    return STATE_UPDATE_TILE_NS[-1]


def state_update_constants(tile_n: int) -> dict:
    return dict(TP=max(8, min(64, STATE_UPDATE_TILE_ELEMS // tile_n)), TN=tile_n)


# Occupancy where every array the kernel reads or writes as tiles has 16-byte rows (rows_of_16_bytes): those
# builds copy by TMA and build at 64 registers without spills at headdim 64 x dstate 64-256. On the H200 0.684 ->
# 0.465 ms per decode step at batch 256 N=128, 1.443 -> 0.965 at N=256, bit-identical outputs, every GPU suite
# passing (docs/performance-log.md v29). Elsewhere the table's occupancy: at headdim 50 x dstate 100 with a
# bfloat16 state, occupancy 4 spilled, made no TMA copy and wrote wrong values.
STATE_UPDATE_ALIGNED_OCCUPANCY = 4
_ALIGNED_HINTS = (("occupancy", STATE_UPDATE_ALIGNED_OCCUPANCY),)


def rows_of_16_bytes(*tensors) -> bool:
    """Whether each tensor starts on a 16-byte boundary, has a unit last stride (or a last dimension of one)
    and every other stride a multiple of 16 bytes: the stride class in which cuTile's builds copy tiles by TMA."""
    # Runs on every decode step: plain loops over the strides (5 us for seven arrays on the CPU, 12 with any()).
    for t in tensors:
        if t.data_ptr() & 15:
            return False
        st = t.stride()
        if st[-1] != 1 and t.shape[-1] > 1:
            return False
        per16 = 16 // t.element_size()
        for s in st[:-1]:
            if s % per16:
                return False
    return True


def state_update_hints(dtype: str, aligned: bool) -> dict:
    """The hints of state_update's build for activations of dtype: the table's, or occupancy
    STATE_UPDATE_ALIGNED_OCCUPANCY where every tiled array has 16-byte rows (aligned), unless HINT_OVERRIDE
    names state_update."""
    if aligned and "state_update" not in HINT_OVERRIDE:
        return dict(_ALIGNED_HINTS)
    return kernel_hints("state_update", dtype, 0)


def state_update_kernel_for(dtype: str, aligned: bool):
    """The kernel object state_update launches, with state_update_hints' hints (kept per hints, as
    hinted_kernel's; nothing built per decode step)."""
    if aligned and "state_update" not in HINT_OVERRIDE:
        return _hinted("state_update", _ALIGNED_HINTS)
    return hinted_kernel("state_update", dtype, 0)


def state_update_dtypes(act_dtype: str) -> tuple:
    """The dtypes of dt and of the state (each) that the kernel is built for, given the activations' dtype:
    that dtype or float32 (a layer's dt is its activations' dtype; states are float32, or the activations'
    dtype in caches kept in it). Other combinations are converted by the launcher."""
    return (act_dtype,) if act_dtype == "float32" else (act_dtype, "float32")


# ---- helpers ----

def _dense(t):
    """t itself unless a dimension longer than one has stride 0 (an expanded view). The contiguous case, by
    far the most common, is decided by one C call: this runs for every array of every launch."""
    if t.is_contiguous():
        return t
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def _as(t, dtype):
    return _dense(t if t.dtype == dtype else t.to(dtype))


_DUMMIES: dict = {}


def _dummy(ref_tensor, dtype, ndim):
    """A one-element array for a parameter whose input is absent; the kernel never reads or writes it. One per
    (device, dtype, ndim), kept: an allocation costs the host 5-6 us on the H200's machine
    (tests/gpu/launch_cost.py), and a forward passes two or three. Not kept when made inside CUDA-graph
    capture (it would come from the graph's private pool)."""
    key = (ref_tensor.device, dtype, ndim)
    t = _DUMMIES.get(key)
    if t is None:
        t = torch.empty((1,) * ndim, dtype=dtype, device=ref_tensor.device)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DUMMIES[key] = t
    return t


def _d_arg(D, like):
    """(array, has_d) of D as compute_out, segment_out and state_update read it: has_d 0 absent (a dummy), 1 one
    value per head as a float32 (nheads, 1) view, 2 float32 (nheads, headdim)."""
    if D is None:
        return _dummy(like, torch.float32, 2), 0
    Dk = _as(D, torch.float32)
    return (Dk.unsqueeze(1), 1) if Dk.dim() == 1 else (Dk, 2)


def _d_per_channel(D, nheads, headdim, like):
    """D as the float32 (nheads, headdim) array the backward's kernels read (a dummy when D is None)."""
    Dk, has_d = _d_arg(D, like)
    return Dk.expand(nheads, headdim).contiguous() if has_d else Dk


def _kernel_dtype(*tensors) -> bool:
    return all(t.dtype in _KERNEL_DTYPES for t in tensors if t is not None)


_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _stream_handle() -> int:
    """The current CUDA stream's raw handle, from two C calls: torch.cuda.current_stream() builds a Stream
    object through several Python frames, a measurable share of the host time of a call that launches 5-17
    kernels (tests/gpu/host_scan.py). ct.launch takes the handle as an int."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


# Programmatic dependent launch of the forward kernels (each begins with common.dependent_launch_prologue) on
# GPUs of compute capability 9.0 and later: a kernel's launch and scheduling overlap the end of the kernel
# before it, which matters where a call is a few short kernels (T = 1K: tens of microseconds in all).
# M2OPS_PDL=0 turns it off.
PDL = envvars.switch("M2OPS_PDL", True)
PDL_KERNELS = frozenset(("chunk_cumsum_kernel", "chunk_state_kernel", "chunk_state_cb_kernel",
                         "chunk_state_cumsum_cb_kernel", "chunk_state_pass_kernel", "state_passing_kernel",
                         "chunk_cb_kernel",
                         "compute_out_kernel", "compute_out_carry_kernel", "segment_state_kernel", "segment_out_kernel",
                         "varlen_states_kernel"))
_PDL_DEVICE: dict = {}


def _pdl(kernel) -> bool:
    if not PDL or kernel._pyfunc.__name__ not in PDL_KERNELS:
        return False
    index = torch._C._cuda_getDevice()
    if index not in _PDL_DEVICE:
        _PDL_DEVICE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _PDL_DEVICE[index]


def _launch(grid, kernel, args, pdl=None, arrays=None, slot=None):
    """kernel (as the launcher names it; its 32-bit twin is taken where the arrays fit) on the current stream.
    A Step passes its PDL flag and the array arguments, which saves working them out again. slot (a list; a
    ForwardPlan's launches) keeps the kernel chosen on the first launch through it, taken from then on without
    looking at the arrays again."""
    if slot:
        kernel = slot[0]
    else:
        kernel = index_width.for_args(kernel, args if arrays is None else arrays)
        if slot is not None:
            slot.append(kernel)
    ct.launch(_stream_handle(), grid, kernel, args, programmatic_dependent_launch=_pdl(kernel) if pdl is None else pdl)


# ---- launch plans ----
# What a launcher decides from sizes, dtypes, the options present and the device (specialisation, hints, grid,
# the scalar arguments) is worked out once per such key and kept: a call then only converts its inputs,
# allocates its outputs and launches. Working it out each call cost the H200's host about 70 us of Python per
# forward (tests/gpu/launch_cost.py), at T=16K, dstate 64 more than the GPU's time for the whole forward.
# The module's switches are part of the key; while a profiling override (CONSTANT_OVERRIDE, HINT_OVERRIDE,
# STATE_BLOCK_OVERRIDE) is set, plans are worked out each call and not kept.

class Step(NamedTuple):
    """One planned launch: the arrays are the call's, everything else is here."""
    grid: tuple
    kernel: object  # as the launcher names it (64-bit-indexed arrays; _launch takes the 32-bit twin)
    pdl: bool       # programmatic dependent launch (_pdl)
    tail: tuple     # the scalar arguments after the arrays

    def launch(self, arrays: tuple):
        _launch(self.grid, self.kernel, arrays + self.tail, self.pdl, arrays)


def _step(grid, kernel, tail, device) -> Step:
    return Step(tuple(grid), kernel, device.type == "cuda" and _pdl(kernel), tuple(tail))


def _knobs() -> tuple:
    return (CB_IN_BF16, STATES_IN_BF16, LOCAL_STATES_IN_BF16, CHUNK_STATE_TN, CHUNK_STATE_SMALL_TN, PDL,
            index_width.NARROW_INDEX, SEGMENTS_OVERRIDE, SEGMENT_COUNT_OVERRIDE, SEGMENT_MAX_WALK,
            SEGMENT_PROGRAMS_PER_SM, FORWARD_STATE_BLOCK, SUPER_CHUNK, SUPER_CHUNK_DEFAULT_SEQLEN,
            SUPER_CHUNK_DEFAULT_CHUNKS, OUT_CARRY_OVERRIDE, OUT_CARRY_MAX_DSTATE,
            OUT_CARRY_WIDE_SEQLEN, OUT_REVERSE, CHUNK_STATE_ONE_HEAD_MAX_DSTATE, FUSED_CB, FUSED_CUMSUM,
            FUSED_CUMSUM_MAX_CHUNKS, FUSED_PASS, FUSED_PASS_MAX_CHUNKS, FUSED_PASS_BY_HEAD)


def _profiling_override() -> bool:
    """Whether a profiling override of constants, hints or the state_passing block is set: the launchers then
    work everything out on each call and keep nothing."""
    return bool(CONSTANT_OVERRIDE or HINT_OVERRIDE) or STATE_BLOCK_OVERRIDE is not None


def _planned(build):
    """build (a function of hashable arguments) with its results kept per arguments and _knobs()."""
    kept = functools.lru_cache(maxsize=1024)(lambda knobs, args: build(*args))

    @functools.wraps(build)
    def plan(*args):
        if _profiling_override():
            return build(*args)
        return kept(_knobs(), args)
    _PLANS.append(kept)
    return plan


_PLANS: list = []


def clear_plans() -> None:
    """Forget every kept plan (after changing what _sm_count returns, as the CPU emulator does)."""
    for kept in _PLANS:
        kept.cache_clear()
    _FORWARD_PLANS.clear()
    CALL_PLANS.clear()
    with _KEPT_LOCK:
        _KEPT_SCRATCH.clear()


# ---- the three ops ----

@_planned
def _cumsum_plan(b, T, h, L, has_bias, dt_softplus, dt_min, dt_max, device) -> Step:
    k = chunk_cumsum_constants(L)
    n_hblocks = cdiv(h, k["BH"])
    return _step((num_chunks(T, L) * n_hblocks, b, 1), hinted_kernel("chunk_cumsum", "float32", L),
                 (T, n_hblocks, int(has_bias), int(bool(dt_softplus)), float(dt_min), float(dt_max),
                  k["L"], k["BH"]), device)


def chunk_cumsum(dt, A, dt_bias, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    if dt.dtype not in _KERNEL_DTYPES or not supported_chunk_size(chunk_size):
        return ref.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    b, T, h = dt.shape
    A32 = _as(A, torch.float32)
    bias = _as(dt_bias, torch.float32) if dt_bias is not None else A32
    step = _cumsum_plan(b, T, h, chunk_size, dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max),
                        dt.device)
    return _run_cumsum(step, cumsum_shape(b, T, h, chunk_size), _dense(dt), A32, bias)


def _run_cumsum(step: Step, shape: tuple, dt, A32, bias, scratch=None, go=Step.launch):
    """chunk_cumsum's outputs allocated (or scratch's pair of float32 buffers of shape taken) and its kernel
    launched by go, on arguments already in the kernel's form."""
    if scratch is None:
        scratch = (torch.empty(shape, dtype=torch.float32, device=dt.device),
                   torch.empty(shape, dtype=torch.float32, device=dt.device))
    dt_out, dA_cumsum = scratch
    go(step, (dt, A32, bias, dt_out, dA_cumsum))
    return dt_out, dA_cumsum


def _common_dtype(*tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _StatePlan(NamedTuple):
    states_shape: tuple
    local_dtype: torch.dtype  # chunk_state's output (the local states)
    separate: bool            # the entering states in their own array of entering_dtype
    chunk_state: Step
    state_passing: Step
    fused_cb: bool = False    # chunk_state's launch also runs chunk_cb's programs (FUSED_CB); it takes C and cb
    fused_cumsum: bool = False  # ... and does chunk_cumsum's work (FUSED_CUMSUM); it takes dt, A and dt_bias too
    fused_pass: bool = False  # chunk_state's launch also does state_passing's work (FUSED_PASS), which is not launched
    pass_shapes: tuple = ()   # (its counters' shape, int32; its chunk ends' shape, float32) under fused_pass


# The planned forward launches chunk_cb's programs in front of chunk_state's, in one launch
# (chunk_state.chunk_state_cb_kernel), instead of launching chunk_cb between state_passing and the output kernel:
# one dependent launch fewer. The planned forward only (no seq_idx): the launchers' path runs the two ops' kernels
# as the ops do. Off by itself: measured (performance-log v40, H100) it gains 1-3 us at 1K, where FUSED_CUMSUM
# (which includes it) gains more, is within noise at 4K and costs 3-4% at 16K and 64K.
FUSED_CB = False
# ... and chunk_cumsum's work too (chunk_state.chunk_state_cumsum_cb_kernel: each state program forms its chunk's dt
# and cumulative sums from dt, and the first headdim and dstate tile's program stores them for the kernels after
# it): three dependent launches. Built at FUSED_CUMSUM_CHUNKS only, for dt in float32 or the activations' dtype.
# On by default up to FUSED_CUMSUM_MAX_CHUNKS chunks: measured (docs/performance-log.md v40, H100, CUDA graph
# replays, H=80 P=64 bf16 chunk 256) it takes 2.7-4.0 us off the 1K call (0.0349 -> 0.0312 ms at N=64, 0.0422 ->
# 0.0382 at N=128, 0.0605 -> 0.0578 at N=256, 0.0945 -> 0.0918 at N=512), is within noise at 4K (+1% at N=64,
# -1% at N=128) and costs 2-3% at 16K and 64K, where the launches it saves are a small part of the call and its
# state programs (one per headdim and dstate tile, each forming the chunk's sums) do more than chunk_cumsum did.
FUSED_CUMSUM = True
FUSED_CUMSUM_MAX_CHUNKS = 4
FUSED_CUMSUM_CHUNKS = (256,)


# state_passing's work in chunk_state's launch too (chunk_state.chunk_state_pass_kernel): the last program of each
# state tile to finish walks the tile's chunks (pass_if_last), so the launch after chunk_state's is the output
# kernel's. The walk is one program's per tile, as long as there are chunks, so only for short sequences (at most
# FUSED_PASS_MAX_CHUNKS chunks: 1K tokens at chunk 256). With FUSED_CB and FUSED_CUMSUM the planned forward at
# 1K tokens is two dependent launches. Built for bfloat16 at FUSED_PASS_CHUNKS, where the planned forward keeps
# bfloat16 local and entering states. Off: measured slower at every 1K point (performance-log v40, H100: +7 to
# +22 us over the same launches without it, 0.0312 -> 0.0385 ms at N=64, 0.0578 -> 0.0761 at N=256), as the
# one program per state tile that walks the chunks starts only when its tile's last chunk is done and walks alone,
# where state_passing spreads the same walk over many more, smaller programs.
FUSED_PASS = False
FUSED_PASS_MAX_CHUNKS = 4
FUSED_PASS_CHUNKS = (256,)
# At two heads a program, the walk takes one head at a time (half the registers, twice the steps) instead of the
# whole tile: in the sm_90 builds the whole-tile walk spills (40 B at 64-wide tiles, 220 B at 128-wide in the
# 32-bit-indexed builds), the walk by head does not. Measured faster than the whole-tile walk (0.0761 -> 0.0681 ms
# at 1K, N=256), still slower than no FUSED_PASS; off.
FUSED_PASS_BY_HEAD = False


def fused_pass_can_run(dtype: str, chunk_size: int, nchunks: int, local_bf16: bool, has_seq: bool) -> bool:
    """Whether chunk_state_pass_kernel is built for, and FUSED_PASS_MAX_CHUNKS admits, this launch (bfloat16
    activations and local states, separate bfloat16 entering states, no seq_idx)."""
    return (dtype == "bfloat16" and chunk_size in FUSED_PASS_CHUNKS and nchunks <= FUSED_PASS_MAX_CHUNKS
            and local_bf16 and not has_seq)


def fused_pass_constants(chunk_size: int, check: bool, heads: int, tn: int, cb: bool, cumsum: bool,
                         by_head: bool = False) -> dict:
    """chunk_state_pass_kernel's constants: chunk_state's without HAS_SEQ, which fused work it also does, and the
    heads its walk takes at once (HW: 1 by head, else all of the program's)."""
    k = chunk_state_constants(chunk_size, False, check, heads, tn)
    k.pop("HAS_SEQ")
    return {**k, "CB": bool(cb), "CUMSUM": bool(cumsum), "HW": 1 if by_head else k["HB"]}


def fused_cumsum_can_run(chunk_size: int, heads: int) -> bool:
    """Whether chunk_state_cumsum_cb_kernel is built for this chunk size and heads per program (HB heads must lie
    in one of chunk_cumsum's blocks of TILE_H)."""
    return chunk_size in FUSED_CUMSUM_CHUNKS and TILE_H % heads == 0


def fused_cumsum_constants(chunk_size: int, check: bool, heads: int, tn: int) -> dict:
    """chunk_state_cumsum_cb_kernel's constants: chunk_state's without HAS_SEQ (it has no seq_idx)."""
    k = chunk_state_constants(chunk_size, False, check, heads, tn)
    k.pop("HAS_SEQ")
    return k


def cb_programs(out) -> tuple:
    """(programs per group, diagonal blocks only, row block) of the chunk_cb launch of _OutPlan out: what
    _state_plan needs to run those programs in chunk_state's launch."""
    n, L, BL, TN, diag = out.chunk_cb.tail
    return out.chunk_cb.grid[0], bool(diag), BL


@_planned
def _state_plan(b, T, h, p, g, n, L, dname, has_seq, has_init, state_block, separate, entering_dtype,
                device, cb=None, dt_args=None, pass_ok=False) -> _StatePlan:
    """cb: cb_programs(out) to launch chunk_cb's programs with chunk_state's (where the row blocks agree), or
    None. dt_args (with cb): chunk_cumsum's (has_bias, dt_softplus, dt_min, dt_max), to do its work in the same
    launch where that is built (fused_cumsum_can_run), or None. pass_ok: state_passing's work in that launch too
    where it is built (fused_pass_can_run)."""
    nchunks = num_chunks(T, L)
    local_bf16 = (separate and LOCAL_STATES_IN_BF16 and entering_dtype == torch.bfloat16
                  and "bfloat16" in local_dtype_names(dname, L))
    n_ptiles = cdiv(p, TILE_P)
    # 1. Each chunk's local state (from zero) into its slot of states: parallel over chunks.
    k = _bounds_checked("chunk_state", chunk_state_constants(L, has_seq, heads=chunk_state_heads(dname, L, n),
                                                             tn=chunk_state_tn(n)), T, p, n)
    k["HB"] = heads_per_program(k["HB"], h // g)  # (after CONSTANT_OVERRIDE, which may set any HB)
    n_state_tiles = cdiv(n, k["TN"])
    n_programs = nchunks * (h // k["HB"]) * n_ptiles * n_state_tiles
    hints = tuple(sorted(chunk_state_hints(dname, L, k["HB"]).items()))
    consts = (k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["HB"])
    fused = cb is not None and cb[2] == k["BL"] and not has_seq
    fused_cumsum = fused and dt_args is not None and fused_cumsum_can_run(L, k["HB"])
    fused_pass = pass_ok and separate and fused_pass_can_run(dname, L, nchunks, local_bf16, has_seq)
    n_tiles = (h // k["HB"]) * n_ptiles * n_state_tiles
    if fused_pass:
        per_group, diag, _ = cb if fused else (0, False, None)
        has_bias, softplus, dt_min, dt_max = dt_args if fused_cumsum else (False, False, 0.0, 0.0)
        kp = fused_pass_constants(L, k["CHK"], k["HB"], k["TN"], fused, fused_cumsum, FUSED_PASS_BY_HEAD)
        chunk_state = _step((per_group * g + n_programs, b, 1), _hinted("chunk_state_pass", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, per_group, n, int(diag), int(has_bias),
                             int(softplus), float(dt_min), float(dt_max), nchunks, int(has_init),
                             kp["L"], kp["BL"], kp["TP"], kp["TN"], kp["CHK"], kp["HB"], kp["CB"], kp["CUMSUM"],
                             kp["HW"]),
                            device)
    elif fused_cumsum:
        per_group, diag, _ = cb
        has_bias, softplus, dt_min, dt_max = dt_args
        chunk_state = _step((per_group * g + n_programs, b, 1), _hinted("chunk_state_cumsum_cb", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, per_group, n, int(diag), int(has_bias),
                             int(softplus), float(dt_min), float(dt_max), k["L"], k["BL"], k["TP"], k["TN"],
                             k["CHK"], k["HB"]), device)
    elif fused:
        per_group, diag, _ = cb
        chunk_state = _step((per_group * g + n_programs, b, 1), _hinted("chunk_state_cb", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, per_group, n, int(diag), *consts), device)
    else:
        chunk_state = _step((n_programs, b, 1), _hinted("chunk_state", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, *consts), device)
    # 2. The recurrence over chunks, in place (local -> entering state), on flat blocks of each head's state.
    blk = state_block or forward_state_block()
    n_blocks = cdiv(p * n, blk)
    ks = state_passing_constants(blk, has_seq, separate, state_passing_checks(blk, p * n))
    state_passing = _step((h * n_blocks, b, 1), hinted_kernel("state_passing", "float32", L),
                          (T, nchunks, n_blocks, int(has_init), L, ks["BLK"], ks["HAS_SEQ"], ks["LAT"], ks["SEP"],
                           ks["CHK"]),
                          device)
    return _StatePlan(states_shape(b, nchunks, h, p, n), torch.bfloat16 if local_bf16 else torch.float32,
                      separate, chunk_state, state_passing, fused, fused_cumsum, fused_pass,
                      ((b, n_tiles), (b, n_tiles, nchunks * k["HB"])) if fused_pass else ())


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens, state_block=None,
                   entering_dtype=None, varlen_out=True):
    """state_block: the state_passing block size (default: forward_state_block()). entering_dtype
    (bfloat16; without cu_seqlens): the entering states are returned in that dtype, written by state_passing
    to their own buffer (for compute_out alone: chunk_scan's STATES_IN_BF16 experiment). varlen_out=False
    (without cu_seqlens): None in place of the empty varlen states the op returns."""
    L = dt_out.shape[-1]
    if (not _kernel_dtype(x, B, dt_out, dA_cumsum) or dt_out.dtype == torch.float64
            or not supported_chunk_size(L)):
        return ref.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    mma_dtype = _common_dtype(x, B)
    xk, Bk = _as(x, mma_dtype), _as(B, mma_dtype)
    dtk, csk = _as(dt_out, torch.float32), _as(dA_cumsum, torch.float32)
    separate = entering_dtype is not None and cu_seqlens is None
    plan = _state_plan(b, T, h, p, g, n, L, _dtype_name(mma_dtype), seq_idx is not None,
                       initial_states is not None, state_block, separate, entering_dtype if separate else None,
                       dev)
    seq = _as(seq_idx, torch.int32) if seq_idx is not None else _dummy(x, torch.int32, 2)
    init = _as(initial_states, torch.float32) if initial_states is not None else None
    states, final_states = _run_states(plan, entering_dtype if separate else None, xk, Bk, dtk, csk, seq, init)
    # (with separate entering states, states is them; then there are no cu_seqlens, and varlen_states, which reads
    # float32 states, does not run)

    if cu_seqlens is None and not varlen_out:
        return states, final_states, None
    varlen = torch.empty(varlen_states_shape(cu_seqlens, h, p, n), dtype=torch.float32, device=dev)
    if cu_seqlens is not None:
        nseq = cu_seqlens.shape[0] - 1
        n_ptiles, n_ntiles = cdiv(p, TILE_P), cdiv(n, TILE_N)
        kv = varlen_states_constants(L)
        _launch((nseq, h, n_ptiles * n_ntiles), hinted_kernel("varlen_states", _dtype_name(mma_dtype), L),
                (xk, Bk, dtk, csk, states, _as(cu_seqlens, torch.int32), varlen,
                 h // g, n_ntiles, kv["L"], kv["BL"], kv["TP"], kv["TN"]))
    return states, final_states, varlen


def _run_states(plan: _StatePlan, entering_dtype, xk, Bk, dtk, csk, seq, init, scratch=None, go=Step.launch,
                cb_arrays=None, dt_arrays=None, pass_scratch=None):
    """fwd_pass_state's buffers allocated and its two kernels launched by go, on arguments already in the kernels'
    form (init: float32 initial states or None). scratch: the (local, entering) state buffers, given (entering
    None unless plan.separate). Returns the states entering every chunk (in their own entering_dtype array when
    plan.separate, else in place of the local states) and the final states. cb_arrays: (C, cb), for a plan whose
    chunk_state launch also forms C . B^T (plan.fused_cb); dt_arrays: (dt, A, dt_bias or A) as chunk_cumsum takes
    them, for a plan whose chunk_state launch also writes dtk and csk (plan.fused_cumsum). pass_scratch: the
    (counters, chunk ends) of a plan whose chunk_state launch also does state_passing's work (plan.fused_pass), the
    counters zero (the kernel leaves them so); allocated where not given."""
    b, nchunks, h, p, n = plan.states_shape
    pn, dev = p * n, xk.device
    if scratch is None:
        scratch = (torch.empty(plan.states_shape, dtype=plan.local_dtype, device=dev),
                   torch.empty(plan.states_shape, dtype=entering_dtype, device=dev) if plan.separate else None)
    states, entering = scratch
    final_states = torch.empty(final_states_shape(b, h, p, n), dtype=torch.float32, device=dev)
    if plan.fused_pass:
        if pass_scratch is None:
            pass_scratch = (torch.zeros(plan.pass_shapes[0], dtype=torch.int32, device=dev),
                            torch.empty(plan.pass_shapes[1], dtype=torch.float32, device=dev))
        f32_1 = _dummy(xk, torch.float32, 1)
        dts = dt_arrays if plan.fused_cumsum else (_dummy(xk, torch.float32, 3), f32_1, f32_1)
        cbs = cb_arrays if plan.fused_cb else (xk, _dummy(xk, getattr(torch, cb_dtype_name(_dtype_name(xk.dtype))), 5))
        go(plan.chunk_state, (xk, Bk, *dts, dtk, csk, states, *cbs, entering, final_states,
                              init if init is not None else _dummy(xk, torch.float32, 4), *pass_scratch))
        return entering, final_states
    if plan.fused_cumsum:
        go(plan.chunk_state, (xk, Bk, *dt_arrays, dtk, csk, states, *cb_arrays))
    elif plan.fused_cb:
        go(plan.chunk_state, (xk, Bk, dtk, csk, seq, states, *cb_arrays))
    else:
        go(plan.chunk_state, (xk, Bk, dtk, csk, seq, states))
    init = init.reshape(b, h, pn) if init is not None else _dummy(xk, torch.float32, 3)
    go(plan.state_passing, (states.view(b, nchunks, h, pn), csk, seq, init, final_states.view(b, h, pn),
                            entering.view(b, nchunks, h, pn) if plan.separate else _dummy(xk, torch.float32, 4)))
    return (entering if plan.separate else states), final_states


class _OutPlan(NamedTuple):
    cb_shape: tuple
    cb_dtype: torch.dtype
    states_bf16: bool  # compute_out reads bfloat16 entering states as they are (else float32)
    chunk_cb: Step
    compute_out: Step
    carry: bool        # compute_out is compute_out_carry's kernel (it also reads B)


# compute_out_carry (one program per chunk, the state carried through its row blocks) in place of compute_out's
# column walk: None lets out_carry_applies decide, True / False force it where it can run / never (experiments).
OUT_CARRY_OVERRIDE = None
# Both output kernels take the chunks in the order opposite to chunk_state's (last first), a run-time argument:
# x's chunks that chunk_state read last may still be in L2 when compute_out starts. On the H200 2-3% at 4K tokens
# (eager and graph replays), neutral from 16K (docs/performance-log.md v35).
OUT_REVERSE = True
# The largest dstate compute_out_carry holds in one state tile, and the tiles (dstate rounded up) it is built for.
# At dstate 256 and 512 (a (64, 256-512) float32 state, or headdim tiles of 32) it was 1.3-2x slower than the walk
# on the H200 (docs/performance-log.md v34).
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
    if OUT_CARRY_OVERRIDE is not None:
        return bool(OUT_CARRY_OVERRIDE)
    return dstate <= 64 or seqlen >= OUT_CARRY_WIDE_SEQLEN


# compute_out_carry's occupancy hint by its state tile (TN), 16-bit inputs: its registers grow with the (TP, TN)
# float32 state it carries. On the H200 (tests/gpu/variants_scan.py "out carry occ k", bfloat16, chunk 256,
# compute_out_carry ms): TN 64 at 64K 1.141 / 0.714 / 0.648 / 1.198 at occupancy 1 / 2 / 3 / 4; TN 128 at 64K
# 1.305 / 0.878 / 1.318 / 1.317. float32 inputs take 2 (not measured).
OUT_CARRY_OCCUPANCY = {16: 3, 32: 3, 64: 3, 128: 2}


def out_carry_hints(dtype: str, tn: int) -> dict:
    if "compute_out_carry" in HINT_OVERRIDE:
        return dict(HINT_OVERRIDE["compute_out_carry"])
    return {"occupancy": OUT_CARRY_OCCUPANCY[tn] if dtype in ("float16", "bfloat16") else 2}


def out_carry_constants(chunk_size: int, dstate: int, has_seq: bool, dtype: str) -> dict:
    k = compute_out_constants(chunk_size, has_seq, dtype=dtype)
    k["TN"] = max(16, 1 << (dstate - 1).bit_length())
    k.update(CONSTANT_OVERRIDE.get("compute_out_carry", {}))
    return k


@_planned
def _out_plan(b, T, h, p, g, n, L, dname, has_seq, states_dtype, has_d, has_z, device) -> _OutPlan:
    k = _bounds_checked("compute_out", compute_out_constants(L, has_seq, dtype=dname), T, p, n)
    BL = k["BL"]  # sub_block(L), or a profiling override's (128-row blocks at chunk 256: an experiment)
    if L % BL:
        raise ValueError(f"compute_out's row block {BL} must divide the chunk size {L}")
    n_rblocks = cdiv(T, BL)
    carry = out_carry_applies(n, L, T)
    if carry:
        k = _bounds_checked("compute_out_carry", out_carry_constants(L, n, has_seq, dname), T, p, n)
        n_ptiles = cdiv(p, k["TP"])
        hints = tuple(sorted(out_carry_hints(dname, k["TN"]).items()))
        compute_out = _step((cdiv(T, L) * h * n_ptiles, b, 1), _hinted("compute_out_carry", hints),
                            (T, h, h // g, n_ptiles, has_d, int(has_z), int(OUT_REVERSE),
                             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["SBF"]), device)
    else:
        n_ptiles = cdiv(p, k["TP"])
        compute_out = _step((n_rblocks * h * n_ptiles, b, 1), hinted_kernel("compute_out", dname, L),
                            (T, h, h // g, n, n_ptiles, has_d, int(has_z), int(OUT_REVERSE),
                             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["SBF"]), device)
    # C_i . B_j^T once per (chunk, group), lower-triangular blocks of compute_out's row block (the diagonal ones
    # for compute_out_carry); the output kernel reads it for every head.
    kc = chunk_cb_constants(L, BL, diag=carry)
    chunk_cb = _step((n_rblocks * (1 if carry else L // BL), g, b), hinted_kernel("chunk_cb", dname, L),
                     (n, kc["L"], kc["BL"], kc["TN"], kc["DIAG"]), device)
    return _OutPlan(cb_shape(b, T, g, L), getattr(torch, cb_dtype_name(dname)),
                    k["SBF"] and states_dtype == torch.bfloat16, chunk_cb, compute_out, carry)


def _out_applies(dt_out, *tensors) -> bool:
    """Whether compute_out's kernels serve these inputs (else the reference)."""
    return (_kernel_dtype(dt_out, *tensors) and dt_out.dtype != torch.float64
            and supported_chunk_size(dt_out.shape[-1]))


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    L = dt_out.shape[-1]
    if not _out_applies(dt_out, x, C, B, z, dA_cumsum, states):
        return ref.compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    mma_dtype = _common_dtype(x, B, C, z)
    xk, Bk, Ck = _as(x, mma_dtype), _as(B, mma_dtype), _as(C, mma_dtype)
    zk = _as(z, mma_dtype) if z is not None else xk
    Dk, has_d = _d_arg(D, x)
    seq = _as(seq_idx, torch.int32) if seq_idx is not None else _dummy(x, torch.int32, 2)
    plan = _out_plan(b, T, h, p, g, n, L, _dtype_name(mma_dtype), seq_idx is not None, states.dtype, has_d,
                     z is not None, dev)
    y = _run_out(plan, xk, _as(dt_out, torch.float32), _as(dA_cumsum, torch.float32), Ck, Bk,
                 states if plan.states_bf16 else _as(states, torch.float32), Dk, zk, seq)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _run_out(plan: _OutPlan, xk, dtk, csk, Ck, Bk, states, Dk, zk, seq, cb=None, go=Step.launch, cb_done=False):
    """compute_out's buffers allocated (C . B^T's unless given as cb) and its two kernels launched by go, on
    arguments already in the kernels' form (cb_done: cb given and already formed, by a fused chunk_state launch:
    the output kernel alone). y comes out in xk's dtype."""
    if cb is None:
        cb = torch.empty(plan.cb_shape, dtype=plan.cb_dtype, device=xk.device)
    if not cb_done:
        go(plan.chunk_cb, (Ck, Bk, cb))
    y = torch.empty(xk.shape, dtype=xk.dtype, device=xk.device)
    go(plan.compute_out, (xk, dtk, csk, Ck, cb, states, Dk, zk, seq, y, Bk) if plan.carry
       else (xk, dtk, csk, Ck, cb, states, Dk, zk, seq, y))
    return y


def _pow2_bucket(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def chunk_scan_shape_key(x, chunk_size: int, B, z, D, seq_idx) -> str:
    """The shape class chunk_scan is tuned for: dtype, chunk size, dstate and headdim, groups, heads and batch
    exactly; seqlen rounded up to a power of two; which options are present."""
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dtype = _dtype_name(_common_dtype(x, B, z))
    return (f"{dtype}|L{chunk_size}|N{n}|P{p}|G{g}|H{h}|B{b}|T{_pow2_bucket(T)}"
            f"|seq{int(seq_idx is not None)}|D{int(D is not None)}|z{int(z is not None)}")


def chunk_scan_configs(batch, seqlen, nheads, headdim, dstate, chunk_size, device,
                       keep_states: bool = False) -> tuple[dict, list]:
    """(default, candidates) for chunk_scan: the default is the launcher's own choice (no search); the
    candidates are the two-op path at every state_passing block size, the two-op path on sub-chunks of
    SUB_CHUNKS and, for a caller's chunk below SUPER_CHUNK, on chunks of SUPER_CHUNK (the chunk size is the
    kernels' unit of parallel work; y and the final state do not depend on it but through rounding) and, where
    the fused kernels can run, the fused path at several segment counts. Candidates at another chunk size
    compile the kernels at that size when they are timed (the search's budget counts that time too).
    The public function already runs a caller's 64 or 128 at SUPER_CHUNK from SUPER_CHUNK_DEFAULT_SEQLEN tokens
    (ops.dispatch.kernel_chunk_size, before chunk_cumsum), so the super-chunk default below serves the ops called
    directly at those chunk sizes. keep_states (a training forward, which keeps the entering states for its
    backward only at the chunk size it was given): the default stays at that size, since on chunks of
    SUPER_CHUNK the backward would recompute the states."""
    k = segment_constants(dstate, False)
    n_ptiles = cdiv(headdim, k["TP"])
    n_blocks = cdiv(seqlen, k["BL"])
    _, per_seg = segment_count(batch, nheads, n_ptiles, n_blocks, device)
    blk = forward_state_block()
    fused = use_segments(chunk_size, dstate, per_seg)
    default = ({"path": "fused", "ppsm": SEGMENT_PROGRAMS_PER_SM} if fused
               else {"path": "split", "state_block": blk})
    if not fused and not keep_states and super_chunk_by_default(chunk_size, seqlen):
        default = {"path": "split", "state_block": blk, "chunk": SUPER_CHUNK}
    candidates = [{"path": "split", "state_block": b_} for b_ in STATE_BLOCKS]
    candidates += [{"path": "split", "state_block": blk, "chunk": c} for c in SUB_CHUNKS
                   if c < chunk_size and chunk_size % c == 0]
    if chunk_size < SUPER_CHUNK and SUPER_CHUNK % chunk_size == 0 and seqlen > chunk_size:
        candidates.append({"path": "split", "state_block": blk, "chunk": SUPER_CHUNK})
    if segments_can_run(chunk_size, dstate):
        candidates += [{"path": "fused", "ppsm": v} for v in (2, 4, 8, 16)]
    return default, candidates


# (chunk_scan reads the kept lists; it does not change them)
_kept_scan_configs = _planned(chunk_scan_configs)


def _tuned(x) -> bool:
    """Whether the tuning cache decides: CUDA inputs, and no override set for profiling."""
    overridden = (SEGMENTS_OVERRIDE is not None or SEGMENT_COUNT_OVERRIDE is not None
                  or STATE_BLOCK_OVERRIDE is not None)
    return x.is_cuda and not overridden


def _can_search() -> bool:
    """Whether a missing choice may be searched now: not inside CUDA-graph capture or torch.compile tracing,
    and no torch.cuda sync debug mode set (a search waits on CUDA events: a host synchronisation). Otherwise
    the stored choice, or the default, is used."""
    if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
        return False
    return not torch.compiler.is_compiling()


# Cycles per second the GPU sleep below is sized with: at least the clock of the GPUs m2ops is tuned on
# (H200: 1.98 GHz), so that the sleep outlasts the host's issue time.
_SLEEP_CLOCK_HZ = 2.0e9


def median_ms(fn, reps: int = 5) -> float:
    """Median device time of fn in ms over reps calls after one warm-up call (CUDA events; synchronises).

    Each timed call is queued behind a GPU sleep longer than the host takes to issue it, so the events measure
    the kernels back to back, not the host: at short sequences (T=1K) an eager call is host-bound, and timing it
    unqueued ranked the candidates by host noise, while a CUDA graph replays whichever was chosen."""
    fn()  # warm-up (and first compile)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    cycles = int((2 * host_s + 50e-6) * _SLEEP_CLOCK_HZ)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, keep_states=False):
    """y and the final state, through the fused kernels of segments.py or through the fwd_pass_state and
    compute_out kernels (same results up to rounding): the tuned choice for this shape class when the tuning
    cache has one (m2ops.kernels.autotune; a first eager call on a GPU searches, within its budget), else the
    launcher's default (use_segments). keep_states: also return the states entering every chunk where the
    two-op path wrote them in bfloat16 for compute_out (else None), for a backward to reuse
    (m2ops/ops/eager.py)."""
    L = dt_out.shape[-1]
    if (not _kernel_dtype(x, C, B, z, dt_out, dA_cumsum) or dt_out.dtype == torch.float64
            or not supported_chunk_size(L)):
        out = ref.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
        return (*out, None) if keep_states else out
    b, T, h, p = x.shape
    n = B.shape[3]
    default, candidates = _kept_scan_configs(b, T, h, p, n, L, x.device, keep_states)
    config = default
    if _tuned(x):
        def run(cfg):
            return lambda: _chunk_scan_with(cfg, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
        config = autotune.choose("chunk_scan", chunk_scan_shape_key(x, L, B, z, D, seq_idx), default,
                                 candidates, lambda cfg: median_ms(run(cfg)), can_search=_can_search,
                                 device_index=x.device.index or 0)
    return _chunk_scan_with(config, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, keep_states)


# Sub-chunk sizes chunk_scan's tuning tries for the two-op path (more, shorter programs: short sequences).
SUB_CHUNKS = (64, 128)
# The chunk size chunk_scan's tuning also tries when the caller's is smaller (and divides it): the size the
# kernels' tables are tuned for (occupancy, bfloat16 local states), with half or a quarter of the chunk states
# to write and pass. At 128 against 256 the call was up to 1.5x slower from 16K up on an H200 (nineteenth
# session, docs/benchmarks.md).
SUPER_CHUNK = 256
# From this many tokens a caller's chunk of 64 or 128 runs on chunks of SUPER_CHUNK by default (the public function
# decides it before chunk_cumsum: ops.dispatch.kernel_chunk_size; chunk_scan_configs' default for the ops called
# directly): on an H200 the tuner chose it at every point where it was searched (16K and 64K tokens x dstate 64
# and 128 at a caller's chunk of 128, twentieth session; 4K and 8K x dstate 64 and 128, twenty-first session). The
# default's forward at 4K-8K tokens, dstate 64-512, is 1.24-1.83x faster at 256 than at 128 (graph replays,
# twenty-first session); forward+backward at 8K 1.07-1.28x faster, at 4K 1.13x slower (host-bound there).
SUPER_CHUNK_DEFAULT_SEQLEN = 4096
SUPER_CHUNK_DEFAULT_CHUNKS = (64, 128)


def super_chunk_by_default(chunk_size: int, seqlen: int) -> bool:
    """Whether the default runs a caller's chunk_size on chunks of SUPER_CHUNK: 64 and 128 (measured slower than
    256: 128 from 4K to 64K tokens, above; 64 at 64K tokens, dstate 64, 2.249 against 1.234 ms,
    docs/performance-log.md v29), not the smaller sizes, which were not measured."""
    return chunk_size in SUPER_CHUNK_DEFAULT_CHUNKS and seqlen >= SUPER_CHUNK_DEFAULT_SEQLEN


def rechunk(dt_out, dA_cumsum, chunk: int, seqlen: int):
    """dt_out and dA_cumsum of chunk size L as those of chunk size `chunk`, a divisor or a multiple of L: the
    same dt, and the cumulative sum restarted at every sub-chunk (cs minus cs at the end of the previous
    sub-chunk), or carried across the L-chunks of a larger chunk (plus the sums of the chunk's earlier
    L-chunks), over the num_chunks(seqlen, chunk) chunks that hold tokens."""
    b, h, nc, L = dA_cumsum.shape
    if chunk > L:
        r, n2 = chunk // L, num_chunks(seqlen, chunk)
        # Whole L-chunks past the last token padded with dt = 0 and cs = 0 (then flat at the carried sum), as
        # chunk_cumsum pads the tokens past the end of the last chunk.
        pad = (0, 0, 0, n2 * r - nc)
        cs = F.pad(_as(dA_cumsum, torch.float32), pad).reshape(b, h, n2, r, L)
        dt = F.pad(_as(dt_out, torch.float32), pad).reshape(b, h, n2, chunk)
        totals = cs[..., -1]
        cs = cs + (totals.cumsum(-1) - totals)[..., None]
        return dt.contiguous(), cs.reshape(b, h, n2, chunk).contiguous()
    r = L // chunk
    cs = _as(dA_cumsum, torch.float32).reshape(b, h, nc, r, chunk)
    before = torch.cat([cs.new_zeros((b, h, nc, 1)), cs[:, :, :, :-1, -1]], dim=3)
    n2 = num_chunks(seqlen, chunk)
    cs = (cs - before[..., None]).reshape(b, h, nc * r, chunk)[:, :, :n2].contiguous()
    dt = _as(dt_out, torch.float32).reshape(b, h, nc * r, chunk)[:, :, :n2].contiguous()
    return dt, cs


def _scan_entering_dtype(mma_dtype):
    """The dtype chunk_scan's two-op path has state_passing write the entering states in for compute_out:
    bfloat16 where STATES_IN_BF16 applies (bfloat16 activations), else None (float32, in place)."""
    return torch.bfloat16 if STATES_IN_BF16 and mma_dtype == torch.bfloat16 else None


def _chunk_scan_with(config, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx,
                     keep_states=False):
    L0 = dt_out.shape[-1]
    if config.get("chunk", L0) != L0:
        dt_out, dA_cumsum = rechunk(dt_out, dA_cumsum, config["chunk"], x.shape[1])
    if config["path"] == "split":
        states, final_states, _ = fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, None,
                                                 state_block=config.get("state_block"),
                                                 entering_dtype=_scan_entering_dtype(_common_dtype(x, B, C, z)),
                                                 varlen_out=False)
        y = compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
        if keep_states:
            # Only the bfloat16 copy at the caller's chunk size: a float32 one is what a recompute replaces.
            kept = states if (states.dtype == torch.bfloat16 and dt_out.shape[-1] == L0) else None
            return y, final_states, kept
        return y, final_states
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    k = segment_constants(n, seq_idx is not None)
    BL, TP = k["BL"], k["TP"]
    n_ptiles = cdiv(p, TP)
    n_blocks = cdiv(T, BL)
    nseg, per_seg = segment_count(b, h, n_ptiles, n_blocks, x.device, config.get("ppsm"))
    dev = x.device
    nchunks = dt_out.shape[2]
    mma_dtype = _common_dtype(x, B, C, z)
    xk, Bk, Ck = _as(x, mma_dtype), _as(B, mma_dtype), _as(C, mma_dtype)
    zk = _as(z, mma_dtype) if z is not None else xk
    # Flat (b, h, nchunks * L) views of the chunked intermediates (a copy only if they are not contiguous).
    dtk = _as(dt_out, torch.float32).reshape(b, h, nchunks * L)
    csk = _as(dA_cumsum, torch.float32).reshape(b, h, nchunks * L)
    Dk, has_d = _d_arg(D, x)
    seq = _as(seq_idx, torch.int32) if seq_idx is not None else _dummy(x, torch.int32, 2)
    grid = (nseg * h * n_ptiles, b, 1)
    dims = (T, h, h // g, n_ptiles, per_seg, n_blocks, L // BL)
    consts = (k["BL"], k["TP"], k["NT"], k["HAS_SEQ"])

    # 1. Each segment's end state from zero, and its total decay.
    seg_states = torch.empty((b, nseg, h, p, n), dtype=torch.float32, device=dev)
    seg_logcarry = torch.empty((b, h, nseg, 1), dtype=torch.float32, device=dev)
    _launch(grid, hinted_kernel("segment_state", _dtype_name(mma_dtype), L),
            (xk, Bk, dtk, csk, seq, seg_states, seg_logcarry, *dims, *consts))

    # 2. The states entering the segments (in place) and the final state: state_passing over segments,
    # with each segment's decay as a one-position "chunk" (its seq_idx cuts are already in the decay).
    pn = p * n
    blk = forward_state_block()
    n_sblocks = cdiv(pn, blk)
    final_states = torch.empty(final_states_shape(b, h, p, n), dtype=torch.float32, device=dev)
    init = (_as(initial_states, torch.float32).reshape(b, h, pn) if initial_states is not None
            else _dummy(x, torch.float32, 3))
    ks = state_passing_constants(blk, False, check=state_passing_checks(blk, pn))
    _launch((h * n_sblocks, b, 1), state_passing_kernel,
            (seg_states.view(b, nseg, h, pn), seg_logcarry, _dummy(x, torch.int32, 2), init,
             final_states.view(b, h, pn), _dummy(x, torch.float32, 4), T, nseg, n_sblocks,
             int(initial_states is not None), 1, ks["BLK"], ks["HAS_SEQ"], ks["LAT"], ks["SEP"], ks["CHK"]))

    # 3. y, walking each segment from its entering state.
    y = torch.empty(x.shape, dtype=mma_dtype, device=dev)
    _launch(grid, hinted_kernel("segment_out", _dtype_name(mma_dtype), L),
            (xk, dtk, csk, Ck, Bk, seq, seg_states, Dk, zk, y, *dims, has_d, int(z is not None),
             *consts))
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return (y, final_states, None) if keep_states else (y, final_states)


# ---- a whole eager forward, planned once per signature ----
# The public function's eager path (m2ops/ops/eager.py) calls chunk_cumsum and then chunk_scan, and each
# launcher re-derives on every call what the inputs' sizes, dtypes and options decide: the dtypes to convert to,
# the tuned configuration, the plans. A ForwardPlan keeps all of it for one signature, so that a repeated call
# only allocates its buffers and launches its five kernels, through the same _run_* functions as the launchers.
# Two more host costs go (v23): the five scratch buffers come from one allocation (torch.empty cost the H200's
# host 5-9 us each), and each launch takes the kernel (64- or 32-bit-indexed) its first call resolved, since
# the plan's arrays have the same sizes and layouts on every call.

_SCRATCH_ALIGN = 512  # bytes: the caching allocator's own alignment, so each view starts as a fresh tensor would


class _Resolved:
    """go() for one ForwardPlan's launches: each step as the kernel index_width.for_args chose on the step's first
    launch (the plan's signature fixes every array's size and layout, so the choice cannot change), launched
    without the per-call check of its arrays."""
    __slots__ = ("slots",)

    def __init__(self):
        self.slots = {}

    def __call__(self, step: Step, arrays: tuple):
        slot = self.slots.get(id(step))  # (the plan holds its steps, so an id stays its step's)
        if slot is None:
            slot = self.slots[id(step)] = []
        _launch(step.grid, step.kernel, arrays + step.tail, step.pdl, arrays, slot)


def _scratch_layout(specs) -> tuple:
    """((dtype, shape, stride, offset in elements) or None for each (dtype, shape) or None of specs, total
    bytes): contiguous buffers laid end to end in one byte array, each starting at a multiple of
    _SCRATCH_ALIGN bytes."""
    out, at = [], 0
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = spec
        stride, size = [], 1
        for extent in reversed(shape):
            stride.insert(0, size)
            size *= extent
        out.append((dtype, tuple(shape), tuple(stride), at // dtype.itemsize))
        at += cdiv(size * dtype.itemsize, _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return tuple(out), max(at, _SCRATCH_ALIGN)


def _scratch_views(layout, total, device) -> tuple:
    """The buffers of _scratch_layout, as views of one fresh allocation: one dtype view of it per dtype, then an
    as_strided per buffer (the cheapest views on the host; a slice, a dtype view and a shape view cost about
    three times as much)."""
    ws = torch.empty((total,), dtype=torch.uint8, device=device)
    typed, out = {}, []
    for v in layout:
        if v is None:
            out.append(None)
            continue
        dtype, shape, stride, offset = v
        w = typed.get(dtype)
        if w is None:
            w = typed[dtype] = ws.view(dtype)
        out.append(w.as_strided(shape, stride, offset))
    return tuple(out)


# A planned call's scratch kept for the next call with the same layout on the same stream from the same thread,
# instead of a fresh allocation and five views (13-37 us of the H200's host per call at 1K-4K tokens, where an
# eager call waits on the host: tests/gpu/scratch_keep.py, docs/performance-log.md v33). Safe because the kernels of consecutive calls on one stream run in order (PDL
# only overlaps a kernel's launch: every forward kernel waits for the one before it before any load or store),
# and nothing outside the call ever sees the scratch (y and the final states are fresh each call). Per thread,
# since two threads issuing on one stream would interleave their launches. Never under CUDA-graph capture (a
# graph would bake in the kept buffers, which later eager calls overwrite). Least recently used entries go once
# the kept total passes M2OPS_SCRATCH_KEEP_MB (default 64; 0 keeps none).
SCRATCH_KEEP_BYTES = envvars.mebibytes("M2OPS_SCRATCH_KEEP_MB", 64)
# (id of the layout, stream, thread) -> (layout, views, bytes), least recently used first
_KEPT_SCRATCH: collections.OrderedDict = collections.OrderedDict()
_KEPT_LOCK = threading.Lock()


def _planned_scratch(fp, device) -> tuple:
    """fp's scratch views: the kept ones for this stream and thread where allowed (above), else fresh (FUSED_PASS's
    counters zeroed: its kernel leaves them zero, so kept ones stay so; under CUDA-graph capture the zeroing is
    captured too)."""
    if (device.type != "cuda" or fp.scratch_bytes > SCRATCH_KEEP_BYTES
            or torch._C._cuda_isCurrentStreamCapturing()):
        return _fresh_scratch(fp, device)
    key = (id(fp.scratch), _stream_handle(), threading.get_ident())
    with _KEPT_LOCK:
        got = _KEPT_SCRATCH.get(key)
        # (the entry holds its layout, so its id names no other layout while it is kept)
        if got is not None and got[0] is fp.scratch:
            _KEPT_SCRATCH.move_to_end(key)
            return got[1]
    views = _fresh_scratch(fp, device)
    with _KEPT_LOCK:
        _KEPT_SCRATCH[key] = (fp.scratch, views, fp.scratch_bytes)
        total = sum(v[2] for v in _KEPT_SCRATCH.values())
        while total > SCRATCH_KEEP_BYTES:
            _, (_, _, nbytes) = _KEPT_SCRATCH.popitem(last=False)
            total -= nbytes
    return views


# Position of FUSED_PASS's counters among a ForwardPlan's scratch views (ForwardPlan.scratch).
_COUNTERS = 5


def _fresh_scratch(fp, device) -> tuple:
    """fp's scratch views on a new allocation, with FUSED_PASS's counters (where the plan has them) zeroed."""
    views = _scratch_views(fp.scratch, fp.scratch_bytes, device)
    if len(views) > _COUNTERS and views[_COUNTERS] is not None:
        views[_COUNTERS].zero_()
    return views


def kept_scratch_bytes() -> int:
    """Bytes of scratch kept between planned calls now (_planned_scratch)."""
    with _KEPT_LOCK:
        return sum(v[2] for v in _KEPT_SCRATCH.values())


class ForwardPlan(NamedTuple):
    tune_key: object      # chunk_scan's tuning-cache key (None for an untuned call: CPU tensors)
    config: dict          # chunk_scan's configuration when the plan was made
    from_default: bool    # config was the default because the cache had no entry (tuning off)
    cumsum: Step
    cumsum_shape: tuple
    states: object        # _StatePlan
    entering_dtype: object  # the separate entering states' dtype, or None
    out: object           # _OutPlan (None: no plan for this signature, take the launchers)
    scratch: tuple = ()   # _scratch_layout of dt_out, dA_cumsum, local states, entering states (or None), cb,
    #                       and FUSED_PASS's counters and chunk ends (or None)
    scratch_bytes: int = 0
    go: object = None     # _Resolved


def forward_plan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max):
    """The ForwardPlan of a forward without seq_idx on these inputs (validated, contiguous), or None for now: a
    profiling override is set, CUDA-graph capture is on, or chunk_scan's tuning may still search this shape.
    A plan whose `out` is None says the call must take the launchers one by one: inputs the kernels take only
    after a conversion (other dtypes, or x, B, C, z of different dtypes), or chunk_scan's fused path as the
    configuration. A configuration at another chunk size (sub- or super-chunks) is planned at that chunk size
    throughout, chunk_cumsum included: the launchers' path, which receives chunk_cumsum's output at the caller's
    chunk size, re-cuts it with `rechunk` (several PyTorch operations), so the two agree up to the rounding of the
    cumulative sums."""
    if _profiling_override() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L, dev = chunk_size, x.device
    none = ForwardPlan(None, {}, False, None, (), None, None, None)
    if (not supported_chunk_size(L) or x.dtype not in _KERNEL_DTYPES or dt.dtype not in _KERNEL_DTYPES
            or B.dtype != x.dtype or C.dtype != x.dtype or (z is not None and z.dtype != x.dtype)
            or any(t is not None and t.dtype != torch.float32 for t in (A, D, dt_bias, initial_states))):
        return none
    default, _ = _kept_scan_configs(b, T, h, p, n, L, dev)
    tune_key, config, from_default = None, default, False
    if _tuned(x):
        tune_key = autotune.full_key("chunk_scan", chunk_scan_shape_key(x, L, B, z, D, None), dev.index or 0)
        found = autotune.lookup(tune_key)
        if found is None and autotune.enabled():
            return None  # the launchers' path may search now
        config, from_default = (default, True) if found is None else (found, False)
    sub = config.get("chunk", L)
    if config["path"] != "split" or (L % sub and sub % L):
        return none._replace(tune_key=tune_key, config=config, from_default=from_default)
    dname = _dtype_name(x.dtype)
    entering = _scan_entering_dtype(x.dtype)
    pass_ok = FUSED_PASS
    states = _state_plan(b, T, h, p, g, n, sub, dname, False, initial_states is not None, config.get("state_block"),
                         entering is not None, entering, dev, None, None, pass_ok)
    _, has_d = _d_arg(D, x)
    out = _out_plan(b, T, h, p, g, n, sub, dname, False, entering if entering is not None else states.local_dtype,
                    has_d, z is not None, dev)
    if (entering is not None) != out.states_bf16:
        return none  # compute_out would convert the states first
    dt_args = ((dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max))
               if FUSED_CUMSUM and num_chunks(T, sub) <= FUSED_CUMSUM_MAX_CHUNKS
               and dt.dtype in (torch.float32, x.dtype) else None)
    if FUSED_CB or dt_args is not None:
        states = _state_plan(b, T, h, p, g, n, sub, dname, False, initial_states is not None,
                             config.get("state_block"), entering is not None, entering, dev, cb_programs(out),
                             dt_args, pass_ok)
        if dt_args is not None and not states.fused_cumsum and not FUSED_CB:
            states = _state_plan(b, T, h, p, g, n, sub, dname, False, initial_states is not None,
                                 config.get("state_block"), entering is not None, entering, dev, None, None, pass_ok)
    cumsum = _cumsum_plan(b, T, h, sub, dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max), dev)
    cs_shape = cumsum_shape(b, T, h, sub)
    passing = states.pass_shapes
    layout, nbytes = _scratch_layout(((torch.float32, cs_shape), (torch.float32, cs_shape),
                                      (states.local_dtype, states.states_shape),
                                      (entering, states.states_shape) if states.separate else None,
                                      (out.cb_dtype, out.cb_shape),
                                      (torch.int32, passing[0]) if passing else None,
                                      (torch.float32, passing[1]) if passing else None))
    return ForwardPlan(tune_key, config, from_default, cumsum, cs_shape, states, entering, out, layout, nbytes,
                       _Resolved())


def forward_plan_current(fp: ForwardPlan) -> bool:
    """Whether chunk_scan would still choose fp's configuration: the tuning cache's entry for its key is the one
    the plan was made with, or, for a plan made on the default, there is still none and tuning is still off."""
    if fp.tune_key is None:
        return True
    found = autotune.lookup(fp.tune_key)
    if found is None:
        return fp.from_default and not autotune.enabled()
    return found == fp.config


_FORWARD_PLANS: dict = {}


def planned_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max,
                    call_key=None):
    """y and the final states of a forward without seq_idx, through this signature's ForwardPlan; None where the
    call must take the launchers: no plan; the profiler on (the launchers then run inside record_functions named
    after their ops); a profiling override set (the launchers honour it); an input not contiguous. Inputs as the
    public function passes them, validated. call_key (the public call's, m2ops/ops/eager.py call_key): the plan
    is also kept under it in CALL_PLANS, for the next call with that key to go to it directly."""
    if torch.autograd._profiler_enabled() or _profiling_override():
        return None
    if not all(t is None or t.is_contiguous() for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)):
        return None
    sig = (x.shape, B.shape, x.device, x.dtype, dt.dtype, A.dtype, B.dtype, C.dtype,
           None if D is None else (D.shape, D.dtype), None if z is None else z.dtype,
           None if dt_bias is None else dt_bias.dtype, None if initial_states is None else initial_states.dtype,
           chunk_size, bool(dt_softplus), dt_min, dt_max, _knobs())
    fp = _FORWARD_PLANS.get(sig)
    if fp is None or not forward_plan_current(fp):
        fp = forward_plan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max)
        if fp is None:
            _FORWARD_PLANS.pop(sig, None)
            return None
        if len(_FORWARD_PLANS) >= 1024:
            _FORWARD_PLANS.clear()
        _FORWARD_PLANS[sig] = fp
    if fp.out is None:
        return None
    if call_key is not None:
        if len(CALL_PLANS) >= 1024:
            CALL_PLANS.clear()
        CALL_PLANS[call_key] = fp
    return run_forward(fp, x, dt, A, B, C, D, z, dt_bias, initial_states)


# The public call's own key (eager.call_key: its arguments' types, sizes, dtypes, devices, layouts and plain
# values, with _knobs()) -> the ForwardPlan a validated call with that key ran, kept by planned_forward. A
# repeated call finds its plan here before any check, lookup or dispatch (eager.remembered_call).
CALL_PLANS: dict = {}


def run_forward(fp: ForwardPlan, x, dt, A, B, C, D, z, dt_bias, initial_states):
    """y and the final states of chunk_cumsum and chunk_scan's two-op path, by fp (whose out is not None): the
    same launches, buffers and bits as the launchers give (with a configuration at another chunk size, those of the
    launchers called at that chunk size: forward_plan)."""
    dt_out, dA_cumsum, local, entering, cb, counters, chunk_ends = _planned_scratch(fp, x.device)
    go = fp.go
    bias = dt_bias if dt_bias is not None else A
    if not fp.states.fused_cumsum:
        _run_cumsum(fp.cumsum, fp.cumsum_shape, dt, A, bias, (dt_out, dA_cumsum), go)
    seq = _dummy(x, torch.int32, 2)
    states, final_states = _run_states(fp.states, fp.entering_dtype, x, B, dt_out, dA_cumsum, seq, initial_states,
                                       (local, entering), go, (C, cb), (dt, A, bias), (counters, chunk_ends))
    y = _run_out(fp.out, x, dt_out, dA_cumsum, C, B, states, _d_arg(D, x)[0], z if z is not None else x, seq, cb,
                 go, fp.states.fused_cb)
    return y, final_states


# ---- decode ----

def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float):
    """m2ops::state_update on the GPU: (y like x, new_state of state's dtype), inputs never written.

    float64 x, B, C, z, state or dt runs the reference (it computes in float64 then). x, B, C and z are read
    in their promoted dtype (converted when they differ; y converted back to x's dtype); dt and state in that
    dtype or float32 (others converted to float32; the new state is then converted back to state's dtype);
    A, dt_bias and D in float32 (converted when not). One launch otherwise: the outputs are fresh tensors,
    there is no host synchronisation and nothing depends on tensor values (CUDA-graph capturable)."""
    if not _kernel_dtype(x, B, C, z, state, dt):
        return ref_su.state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max)
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dev = x.device
    act = _common_dtype(x, B, C, z)
    xk, Bk, Ck = _as(x, act), _as(B, act), _as(C, act)
    zk = _as(z, act) if z is not None else xk
    dtk = _dense(dt) if dt.dtype in (act, torch.float32) else _as(dt, torch.float32)
    state_k = _dense(state) if state.dtype in (act, torch.float32) else _as(state, torch.float32)
    A32 = _as(A, torch.float32)
    bias = _as(dt_bias, torch.float32) if dt_bias is not None else A32
    Dk, has_d = _d_arg(D, x)

    y = torch.empty((b, h, p), dtype=act, device=dev)
    new_state = torch.empty((b, h, p, n), dtype=state_k.dtype, device=dev)
    k = state_update_constants(state_update_tile_n(n))
    n_ptiles = cdiv(p, k["TP"])
    tiled = (state_k, xk, Bk, Ck, new_state, y) + ((zk,) if z is not None else ()) + ((Dk,) if has_d == 2 else ())
    kernel = state_update_kernel_for(_dtype_name(act), rows_of_16_bytes(*tiled))
    _launch((h * n_ptiles, b, 1), kernel,
            (state_k, xk, dtk, A32, Bk, Ck, Dk, zk, bias, new_state, y,
             h, h // g, n, n_ptiles, has_d, int(z is not None), int(dt_bias is not None),
             int(bool(dt_softplus)), float(dt_min), float(dt_max),
             k["TP"], k["TN"]))
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if new_state.dtype != state.dtype:
        new_state = new_state.to(state.dtype)
    return y, new_state
