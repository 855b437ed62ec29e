"""The chunk_scan launcher (fwd_pass_state and compute_out as one op: y and the final state) and its tuning.

chunk_scan runs the two-op kernels (forward.py) or the fused segment kernels (segments.py), at the caller's chunk
size or at another (sub-chunks, or chunks of SUPER_CHUNK): the configuration stored in the tuning cache for the
shape class (autotune.py), else the default (chunk_scan_configs). A search, which times the candidates with
median_ms, runs only where the user asked for one (m2ops.pretune, python -m m2ops.tuning, M2OPS_AUTOTUNE=1).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..meta.shapes import final_states_shape, num_chunks
from . import autotune, config, registry, runtime
from .common import SEGMENT_BL, SEGMENT_MAX_DSTATE, SEGMENT_MAX_WALK, SEGMENT_PROGRAMS_PER_SM, STATE_BLOCKS, cdiv
from .forward import compute_out, fwd_pass_state
from .runtime import as_dtype, common_dtype, d_arg, dtype_name, dummy, planned
from .specialise import (forward_state_block, hinted_kernel, segment_constants, state_passing_checks,
                         state_passing_constants)


def segment_count(batch: int, nheads: int, n_ptiles: int, n_blocks: int, device,
                  programs_per_sm: int | None = None) -> tuple[int, int]:
    """(segments, blocks per segment) of the fused scan: about programs_per_sm (default
    SEGMENT_PROGRAMS_PER_SM) programs per SM, at most one segment per block. More segments mean more parallel
    programs and shorter sequential walks, but more segment states (a few MB) and a longer pass over them."""
    want = config.current().segment_count
    if want is None:
        ppsm = SEGMENT_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        want = cdiv(ppsm * runtime.sm_count(device), batch * nheads * n_ptiles)
    nseg = max(1, min(n_blocks, want))
    per_seg = cdiv(n_blocks, nseg)
    return cdiv(n_blocks, per_seg), per_seg


def segments_can_run(chunk_size: int, dstate: int) -> bool:
    """The fused segment kernels exist for dstate <= 128 and chunks of at least one 64-token block."""
    return dstate <= SEGMENT_MAX_DSTATE and chunk_size >= SEGMENT_BL


def use_segments(chunk_size: int, dstate: int, blocks_per_seg: int) -> bool:
    """Whether chunk_scan runs the fused segment kernels (else the fwd_pass_state and compute_out kernels):
    only where they can (segments_can_run) and were measured faster (short walks; see
    common.SEGMENT_MAX_WALK). config.current().segments forces either where they can."""
    if not segments_can_run(chunk_size, dstate):
        return False
    forced = config.current().segments
    if forced is not None:
        return bool(forced)
    return blocks_per_seg <= SEGMENT_MAX_WALK


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
    dtype = dtype_name(common_dtype(x, B, z))
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
    The public function already runs a caller's 64 or 128 at SUPER_CHUNK from the config's super_chunk_min_seqlen
    tokens (ops.dispatch.kernel_chunk_size, before chunk_cumsum), so the super-chunk default below serves the ops
    called directly at those chunk sizes. keep_states (a training forward, which keeps the entering states for its
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
kept_scan_configs = planned(chunk_scan_configs)


def tuned(x) -> bool:
    """Whether the tuning cache decides: CUDA inputs, and no path, segment count or block forced by the config."""
    cfg = config.current()
    return x.is_cuda and cfg.segments is None and cfg.segment_count is None and cfg.state_block is None


def can_search() -> bool:
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
    cache has one (m2ops.kernels.autotune; a search runs only where one was asked for: m2ops.pretune, the tuning
    command line, M2OPS_AUTOTUNE=1), else the launcher's default. keep_states: also return the states entering every chunk where the
    two-op path wrote them in bfloat16 for compute_out (else None), for a backward to reuse
    (m2ops/ops/eager.py)."""
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    n = B.shape[3]
    default, candidates = kept_scan_configs(b, T, h, p, n, L, x.device, keep_states)
    choice = default
    if tuned(x):
        def run(cfg):
            return lambda: chunk_scan_with(cfg, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
        choice = autotune.choose("chunk_scan", chunk_scan_shape_key(x, L, B, z, D, seq_idx), default,
                                 candidates, lambda cfg: median_ms(run(cfg)), can_search=can_search,
                                 device_index=x.device.index or 0)
    return chunk_scan_with(choice, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, keep_states)


# Sub-chunk sizes chunk_scan's tuning tries for the two-op path (more, shorter programs: short sequences).
SUB_CHUNKS = (64, 128)


# The chunk size chunk_scan's tuning also tries when the caller's is smaller (and divides it): the size the
# kernels' tables are tuned for (occupancy, bfloat16 local states), with half or a quarter of the chunk states
# to write and pass. At 128 against 256 the call was up to 1.5x slower from 16K up on an H200 (2026-12-01,
# docs/history.md). From the config's super_chunk_min_seqlen tokens (4096) a caller's 64 or 128 runs on chunks of
# SUPER_CHUNK by default: on an H200 the tuner chose it at every point where it was searched (4K-64K tokens x
# dstate 64 and 128); the forward at 4K-8K tokens, dstate 64-512, is 1.24-1.83x faster at 256 than at 128 (graph
# replays); forward+backward at 8K 1.07-1.28x faster, at 4K 1.13x slower (host-bound there).
SUPER_CHUNK = 256


SUPER_CHUNK_DEFAULT_CHUNKS = (64, 128)


def super_chunk_by_default(chunk_size: int, seqlen: int) -> bool:
    """Whether the default runs a caller's chunk_size on chunks of SUPER_CHUNK: 64 and 128 (measured slower than
    256: 128 from 4K to 64K tokens, above; 64 at 64K tokens, dstate 64, 2.249 against 1.234 ms,
    docs/history.md v29), not the smaller sizes, which were not measured."""
    return chunk_size in SUPER_CHUNK_DEFAULT_CHUNKS and seqlen >= config.current().super_chunk_min_seqlen


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
        cs = F.pad(as_dtype(dA_cumsum, torch.float32), pad).reshape(b, h, n2, r, L)
        dt = F.pad(as_dtype(dt_out, torch.float32), pad).reshape(b, h, n2, chunk)
        totals = cs[..., -1]
        cs = cs + (totals.cumsum(-1) - totals)[..., None]
        return dt.contiguous(), cs.reshape(b, h, n2, chunk).contiguous()
    r = L // chunk
    cs = as_dtype(dA_cumsum, torch.float32).reshape(b, h, nc, r, chunk)
    before = torch.cat([cs.new_zeros((b, h, nc, 1)), cs[:, :, :, :-1, -1]], dim=3)
    n2 = num_chunks(seqlen, chunk)
    cs = (cs - before[..., None]).reshape(b, h, nc * r, chunk)[:, :, :n2].contiguous()
    dt = as_dtype(dt_out, torch.float32).reshape(b, h, nc * r, chunk)[:, :, :n2].contiguous()
    return dt, cs


def scan_entering_dtype(mma_dtype):
    """The dtype chunk_scan's two-op path has state_passing write the entering states in for compute_out:
    bfloat16 for bfloat16 activations (specialise.entering_dtype_names), else None (float32, in place)."""
    return torch.bfloat16 if mma_dtype == torch.bfloat16 else None


def chunk_scan_with(choice, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, keep_states=False):
    """chunk_scan by the configuration choice (a tuning candidate: the path, its block or segment count, its
    chunk size)."""
    L0 = dt_out.shape[-1]
    if choice.get("chunk", L0) != L0:
        dt_out, dA_cumsum = rechunk(dt_out, dA_cumsum, choice["chunk"], x.shape[1])
    if choice["path"] == "split":
        states, final_states, _ = fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, None,
                                                 state_block=choice.get("state_block"),
                                                 entering_dtype=scan_entering_dtype(common_dtype(x, B, C, z)),
                                                 varlen_out=False)
        y = compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
        if keep_states:
            # Only the bfloat16 copy at the caller's chunk size: a float32 one is what a recompute replaces.
            kept = states if (states.dtype == torch.bfloat16 and dt_out.shape[-1] == L0) else None
            return y, final_states, kept
        return y, final_states
    y, final_states = _segments_scan(choice, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
    return (y, final_states, None) if keep_states else (y, final_states)


def _segments_scan(choice, x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx):
    """y and the final state through the fused segment kernels (segments.py): no per-chunk states in memory."""
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    k = segment_constants(n, seq_idx is not None)
    BL, TP = k["BL"], k["TP"]
    n_ptiles = cdiv(p, TP)
    n_blocks = cdiv(T, BL)
    nseg, per_seg = segment_count(b, h, n_ptiles, n_blocks, x.device, choice.get("ppsm"))
    dev = x.device
    nchunks = dt_out.shape[2]
    mma_dtype = common_dtype(x, B, C, z)
    xk, Bk, Ck = as_dtype(x, mma_dtype), as_dtype(B, mma_dtype), as_dtype(C, mma_dtype)
    zk = as_dtype(z, mma_dtype) if z is not None else xk
    # Flat (b, h, nchunks * L) views of the chunked intermediates (a copy only if they are not contiguous).
    dtk = as_dtype(dt_out, torch.float32).reshape(b, h, nchunks * L)
    csk = as_dtype(dA_cumsum, torch.float32).reshape(b, h, nchunks * L)
    Dk, has_d = d_arg(D, x)
    seq = as_dtype(seq_idx, torch.int32) if seq_idx is not None else dummy(x, torch.int32, 2)
    grid = (nseg * h * n_ptiles, b, 1)
    dims = (T, h, h // g, n_ptiles, per_seg, n_blocks, L // BL)
    consts = (k["BL"], k["TP"], k["NT"], k["HAS_SEQ"])

    # 1. Each segment's end state from zero, and its total decay.
    seg_states = torch.empty((b, nseg, h, p, n), dtype=torch.float32, device=dev)
    seg_logcarry = torch.empty((b, h, nseg, 1), dtype=torch.float32, device=dev)
    runtime.launch(grid, hinted_kernel("segment_state", dtype_name(mma_dtype), L),
            (xk, Bk, dtk, csk, seq, seg_states, seg_logcarry, *dims, *consts))

    # 2. The states entering the segments (in place) and the final state: state_passing over segments,
    # with each segment's decay as a one-position "chunk" (its seq_idx cuts are already in the decay).
    pn = p * n
    blk = forward_state_block()
    n_sblocks = cdiv(pn, blk)
    final_states = torch.empty(final_states_shape(b, h, p, n), dtype=torch.float32, device=dev)
    init = (as_dtype(initial_states, torch.float32).reshape(b, h, pn) if initial_states is not None
            else dummy(x, torch.float32, 3))
    ks = state_passing_constants(blk, False, check=state_passing_checks(blk, pn))
    runtime.launch((h * n_sblocks, b, 1), registry.KERNELS["state_passing"],
            (seg_states.view(b, nseg, h, pn), seg_logcarry, dummy(x, torch.int32, 2), init,
             final_states.view(b, h, pn), dummy(x, torch.float32, 4), T, nseg, n_sblocks,
             int(initial_states is not None), 1, ks["BLK"], ks["HAS_SEQ"], ks["LAT"], ks["SEP"], ks["CHK"]))

    # 3. y, walking each segment from its entering state.
    y = torch.empty(x.shape, dtype=mma_dtype, device=dev)
    runtime.launch(grid, hinted_kernel("segment_out", dtype_name(mma_dtype), L),
            (xk, dtk, csk, Ck, Bk, seq, seg_states, Dk, zk, y, *dims, has_d, int(z is not None),
             *consts))
    return (y if y.dtype == x.dtype else y.to(x.dtype)), final_states
