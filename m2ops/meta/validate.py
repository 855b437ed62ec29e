"""Input validation of the public interface: every error names the argument and what was expected.

check_inputs looks at shapes, dtypes, devices and plain values only, so it is free and traceable by
torch.compile. check_values reads tensor contents (seq_idx and cu_seqlens), which needs a device-to-host copy;
it runs in eager mode only (see should_check_values).
"""

from __future__ import annotations

import torch

from .. import envvars

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
_WHERE = "m2ops.mamba_chunk_scan_combined"


def _fail(kind, name, expected, got, where=_WHERE):
    raise kind(f"{where}: {name} must be {expected}; got {got}")


def _tensor(name, t, dtypes, expected_kind, where=_WHERE):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__, where)
    if t.dtype not in dtypes:
        _fail(TypeError, name, f"a tensor of {expected_kind} dtype ({', '.join(str(d) for d in dtypes)})",
              t.dtype, where)


def _shape(name, t, expected, desc, where=_WHERE):
    if tuple(t.shape) != tuple(expected):
        _fail(ValueError, name, f"of shape {desc} = {tuple(expected)}", tuple(t.shape), where)


def _device(name, t, device, where=_WHERE):
    if t.device != device:
        _fail(ValueError, name, f"on the same device as x ({device})", t.device, where)


def check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                 dt_limit, return_final_states, return_varlen_states):
    """Raise TypeError or ValueError for the first argument that does not fit; return nothing."""
    _tensor("x", x, FLOAT_DTYPES, "floating")
    if x.dim() != 4:
        _fail(ValueError, "x", "4-dimensional (batch, seqlen, nheads, headdim)", tuple(x.shape))
    b, T, h, p = x.shape
    if T < 1 or b < 1 or h < 1 or p < 1:
        _fail(ValueError, "x", "non-empty in every dimension (batch, seqlen, nheads, headdim)", tuple(x.shape))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        _fail(TypeError, "chunk_size", "an int", type(chunk_size).__name__)
    if chunk_size <= 0:
        _fail(ValueError, "chunk_size", "a positive int", chunk_size)

    _tensor("dt", dt, FLOAT_DTYPES, "floating")
    _shape("dt", dt, (b, T, h), "(batch, seqlen, nheads)")
    _tensor("A", A, FLOAT_DTYPES, "floating")
    _shape("A", A, (h,), "(nheads,)")
    _tensor("B", B, FLOAT_DTYPES, "floating")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, T):
        _fail(ValueError, "B", f"of shape (batch, seqlen, ngroups, dstate) = ({b}, {T}, ngroups, dstate)",
              tuple(B.shape))
    g, n = B.shape[2], B.shape[3]
    if g < 1 or n < 1 or h % g != 0:
        _fail(ValueError, "B", f"of shape (batch, seqlen, ngroups, dstate) with ngroups dividing nheads={h} "
              "and dstate >= 1", tuple(B.shape))
    _tensor("C", C, FLOAT_DTYPES, "floating")
    _shape("C", C, (b, T, g, n), "(batch, seqlen, ngroups, dstate) like B")

    _check_head_params(D, dt_bias, h, p)
    if z is not None:
        _tensor("z", z, FLOAT_DTYPES, "floating")
        _shape("z", z, (b, T, h, p), "(batch, seqlen, nheads, headdim) like x")
    if initial_states is not None:
        _tensor("initial_states", initial_states, FLOAT_DTYPES, "floating")
        nseq = (cu_seqlens.shape[0] - 1 if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
                else None)
        shape = tuple(initial_states.shape)
        if nseq is not None and nseq > 1 and (shape == (nseq, h, p, n) or shape == (b, h, p, n)):  # (not `in`)
            pass  # the batch form, or one start state per packed sequence (sequence_states.py)
        elif nseq is not None and nseq > 1:
            _fail(ValueError, "initial_states", f"of shape (batch, nheads, headdim, dstate) = {(b, h, p, n)} or, one "
                  f"per packed sequence, (num_sequences, nheads, headdim, dstate) = {(nseq, h, p, n)}",
                  tuple(initial_states.shape))
        else:
            _shape("initial_states", initial_states, (b, h, p, n), "(batch, nheads, headdim, dstate)")
    if seq_idx is not None:
        _tensor("seq_idx", seq_idx, INDEX_DTYPES, "integer")
        _shape("seq_idx", seq_idx, (b, T), "(batch, seqlen)")
    if cu_seqlens is not None:
        _tensor("cu_seqlens", cu_seqlens, INDEX_DTYPES, "integer")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            _fail(ValueError, "cu_seqlens", "1-dimensional (num_sequences + 1,) with at least 2 entries",
                  tuple(cu_seqlens.shape))
        if b != 1:
            _fail(ValueError, "x", "of batch 1 when cu_seqlens packs sequences along seqlen", f"batch {b}")
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias),
                    ("initial_states", initial_states), ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)):
        if t is not None:
            _device(name, t, x.device)

    if not isinstance(dt_softplus, bool):
        _fail(TypeError, "dt_softplus", "a bool", type(dt_softplus).__name__)
    for name, flag in (("return_final_states", return_final_states),
                       ("return_varlen_states", return_varlen_states)):
        if not isinstance(flag, bool):
            _fail(TypeError, name, "a bool", type(flag).__name__)
    if return_varlen_states and cu_seqlens is None:  # after the type check: a non-bool flag is a TypeError
        _fail(ValueError, "cu_seqlens", "given when return_varlen_states=True", None)
    _check_dt_limit(dt_limit)


def check_state_passing_bwd(g_states, g_final, states, dA_cumsum, g_local_dtype,
                            where="m2ops::state_passing_bwd"):
    """The reverse recurrence's inputs beside the cotangents: `states`, the forward's entering states laid out as
    their gradient g_states (batch, nchunks, nheads, headdim, dstate), g_final one chunk's worth, and
    g_local_dtype, a floating dtype."""
    _tensor("states", states, FLOAT_DTYPES, "floating", where)
    _shape("states", states, g_states.shape, "g_states's (batch, nchunks, nheads, headdim, dstate)", where)
    _device("states", states, g_states.device, where)
    b, c, h, p, n = g_states.shape
    _shape("g_final", g_final, (b, h, p, n), "(batch, nheads, headdim, dstate)", where)
    _shape("dA_cumsum", dA_cumsum, (b, h, c, dA_cumsum.shape[-1]), "(batch, nheads, nchunks, chunk_size)", where)
    if not (isinstance(g_local_dtype, torch.dtype) and g_local_dtype.is_floating_point):
        _fail(TypeError, "g_local_dtype", "a floating torch.dtype", g_local_dtype, where)


def check_chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, g_x, g_B, g_dt_out, g_dA_cumsum,
                          where="m2ops::chunk_state_bwd"):
    """The gradients this op adds into (each of its input's shape and on its device, floating), and g_local and
    g_carry as state_passing_bwd gives them."""
    for name, grad, inp, dims in (("g_x", g_x, x, "x's (batch, seqlen, nheads, headdim)"),
                                  ("g_B", g_B, B, "B's (batch, seqlen, ngroups, dstate)"),
                                  ("g_dt_out", g_dt_out, dt_out, "dt_out's (batch, nheads, nchunks, chunk_size)"),
                                  ("g_dA_cumsum", g_dA_cumsum, dA_cumsum,
                                   "dA_cumsum's (batch, nheads, nchunks, chunk_size)")):
        _tensor(name, grad, FLOAT_DTYPES, "floating", where)
        _shape(name, grad, inp.shape, dims, where)
        _device(name, grad, x.device, where)
    b, _, h, p = x.shape
    c = dt_out.shape[2]
    _shape("g_carry", g_carry, (b, h, c), "(batch, nheads, nchunks)", where)
    _shape("g_local", g_local, (b, c, h, p, B.shape[-1]), "(batch, nchunks, nheads, headdim, dstate)", where)


def check_start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens, where="m2ops::start_state_out"):
    """The packed row's output y (1, seqlen, nheads, headdim), C (1, seqlen, ngroups, dstate) with ngroups dividing
    nheads, z like y, initial_states (num_sequences, nheads, headdim, dstate) for cu_seqlens (num_sequences + 1,)
    integer, and dA_cumsum (1, nheads, nchunks, chunk_size) covering seqlen; floating tensors on y's device."""
    _tensor("y", y, FLOAT_DTYPES, "floating", where)
    if y.dim() != 4 or y.shape[0] != 1:
        _fail(ValueError, "y", "of shape (1, seqlen, nheads, headdim)", tuple(y.shape), where)
    _, T, h, p = y.shape
    _tensor("C", C, FLOAT_DTYPES, "floating", where)
    if C.dim() != 4 or tuple(C.shape[:2]) != (1, T) or C.shape[2] < 1 or h % C.shape[2] != 0:
        _fail(ValueError, "C", f"of shape (1, seqlen, ngroups, dstate) = (1, {T}, g, n) with g dividing {h}",
              tuple(C.shape), where)
    if z is not None:
        _tensor("z", z, FLOAT_DTYPES, "floating", where)
        _shape("z", z, y.shape, "y's (1, seqlen, nheads, headdim)", where)
    _tensor("cu_seqlens", cu_seqlens, INDEX_DTYPES, "integer", where)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        _fail(ValueError, "cu_seqlens", "of shape (num_sequences + 1,) with num_sequences >= 1",
              tuple(cu_seqlens.shape), where)
    _tensor("initial_states", initial_states, FLOAT_DTYPES, "floating", where)
    _shape("initial_states", initial_states, (cu_seqlens.shape[0] - 1, h, p, C.shape[3]),
           "(num_sequences, nheads, headdim, dstate)", where)
    _tensor("dA_cumsum", dA_cumsum, FLOAT_DTYPES, "floating", where)
    if dA_cumsum.dim() != 4 or dA_cumsum.shape[-1] < 1:
        _fail(ValueError, "dA_cumsum", "of shape (1, nheads, nchunks, chunk_size)", tuple(dA_cumsum.shape), where)
    L = dA_cumsum.shape[-1]
    _shape("dA_cumsum", dA_cumsum, (1, h, (T + L - 1) // L, L), "(1, nheads, nchunks, chunk_size)", where)
    for name, t in (("C", C), ("z", z), ("initial_states", initial_states), ("dA_cumsum", dA_cumsum),
                    ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != y.device:
            _fail(ValueError, name, f"on the same device as y ({y.device})", t.device, where)


def _check_head_params(D, dt_bias, h, p, where=_WHERE):
    """D ((nheads,) or (nheads, headdim)) and dt_bias ((nheads,)), shared by the scan and the decode step."""
    if D is not None:
        _tensor("D", D, FLOAT_DTYPES, "floating", where)
        if not (tuple(D.shape) == (h,) or tuple(D.shape) == (h, p)):  # not `in`: dynamo gets it wrong on SymInts
            _fail(ValueError, "D", f"of shape (nheads,) = ({h},) or (nheads, headdim) = ({h}, {p})",
                  tuple(D.shape), where)
    if dt_bias is not None:
        _tensor("dt_bias", dt_bias, FLOAT_DTYPES, "floating", where)
        _shape("dt_bias", dt_bias, (h,), "(nheads,)", where)


def _check_dt_limit(dt_limit, where=_WHERE):
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)):
        _fail(TypeError, "dt_limit", "a pair of floats (dt_min, dt_max)", dt_limit, where)
    lo, hi = dt_limit
    if not lo <= hi:  # also catches NaN; math.isnan breaks the graph on dynamo's symbolic floats
        _fail(ValueError, "dt_limit", "(dt_min, dt_max) with dt_min <= dt_max", dt_limit, where)


_WHERE_DECODE = "m2ops.selective_state_update"


def check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                              state_batch_indices=None, out=None, in_place=False):
    """The one-token update's rules (Mamba-2 shapes, one dt and one A per head); errors name the argument.
    With state_batch_indices, state is a cache of any number of rows (cache_rows, nheads, headdim, dstate);
    in_place: state (and out) are written, so they must not be expanded views."""
    w = _WHERE_DECODE
    _tensor("x", x, FLOAT_DTYPES, "floating", w)
    if x.dim() != 3:
        _fail(ValueError, "x", "3-dimensional (batch, nheads, headdim)", tuple(x.shape), w)
    b, h, p = x.shape
    if b < 1 or h < 1 or p < 1:
        _fail(ValueError, "x", "non-empty in every dimension (batch, nheads, headdim)", tuple(x.shape), w)
    _tensor("B", B, FLOAT_DTYPES, "floating", w)
    if B.dim() != 3 or B.shape[0] != b:
        _fail(ValueError, "B", f"of shape (batch, ngroups, dstate) = ({b}, ngroups, dstate)", tuple(B.shape), w)
    g, n = B.shape[1], B.shape[2]
    if g < 1 or n < 1 or h % g != 0:
        _fail(ValueError, "B", f"of shape (batch, ngroups, dstate) with ngroups dividing nheads={h} and "
              "dstate >= 1", tuple(B.shape), w)
    _tensor("C", C, FLOAT_DTYPES, "floating", w)
    _shape("C", C, (b, g, n), "(batch, ngroups, dstate) like B", w)
    _tensor("state", state, FLOAT_DTYPES, "floating", w)
    if state_batch_indices is None:
        _shape("state", state, (b, h, p, n), "(batch, nheads, headdim, dstate)", w)
    else:
        _check_state_cache(state, state_batch_indices, b, h, p, n, w)
    _tensor("dt", dt, FLOAT_DTYPES, "floating", w)
    _shape("dt", dt, (b, h), "(batch, nheads)", w)
    _tensor("A", A, FLOAT_DTYPES, "floating", w)
    _shape("A", A, (h,), "(nheads,)", w)
    _check_head_params(D, dt_bias, h, p, w)
    if z is not None:
        _tensor("z", z, FLOAT_DTYPES, "floating", w)
        _shape("z", z, (b, h, p), "(batch, nheads, headdim) like x", w)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail(TypeError, "out", "a torch.Tensor", type(out).__name__, w)
        if out.dtype != x.dtype:
            _fail(TypeError, "out", f"of x's dtype ({x.dtype})", out.dtype, w)
        _shape("out", out, (b, h, p), "(batch, nheads, headdim) like x", w)
    for name, t in (("state", state), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("dt_bias", dt_bias), ("state_batch_indices", state_batch_indices), ("out", out)):
        if t is not None:
            _device(name, t, x.device, w)
    if in_place:
        for name, t in (("state", state), ("out", out)):
            if t is not None and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
                _fail(ValueError, name, "a tensor whose elements do not share memory (it is written in place)",
                      f"an expanded view of strides {tuple(t.stride())}", w)
    if not isinstance(dt_softplus, bool):
        _fail(TypeError, "dt_softplus", "a bool", type(dt_softplus).__name__, w)
    _check_dt_limit(dt_limit, w)


def _check_state_cache(state, state_batch_indices, b, h, p, n, w):
    """state as a cache that state_batch_indices ((batch,) integers) picks rows of."""
    _tensor("state_batch_indices", state_batch_indices, INDEX_DTYPES, "integer", w)
    _shape("state_batch_indices", state_batch_indices, (b,), "(batch,)", w)
    if state.dim() != 4 or tuple(state.shape[1:]) != (h, p, n) or state.shape[0] < 1:
        _fail(ValueError, "state", f"of shape (cache_rows, nheads, headdim, dstate) = (cache_rows, {h}, {p}, {n}) "
              "with cache_rows >= 1", tuple(state.shape), w)


def check_state_batch_indices(state_batch_indices, cache_rows):
    """The values of state_batch_indices: each below cache_rows (a negative one is a padding slot), the
    non-negative ones distinct (two batch rows must not update one cache row). Reads the values: the decode step
    calls it where they are on the CPU (on a GPU it would cost a host synchronisation per token)."""
    w = _WHERE_DECODE
    rows = state_batch_indices
    if bool((rows >= cache_rows).any()):
        _fail(ValueError, "state_batch_indices", f"below cache_rows = state.shape[0] = {cache_rows} (negative: a "
              "padding slot)", f"the value {int(rows.max())}", w)
    used = rows[rows >= 0]
    if used.unique().numel() != used.numel():
        _fail(ValueError, "state_batch_indices", "distinct where non-negative (one batch row per cache row)",
              "a repeated row", w)


def should_check_values(*tensors) -> bool:
    """Content checks need a host copy: skipped while torch.compile traces or a CUDA graph captures, and
    when M2OPS_CHECK_VALUES=0."""
    if all(t is None for t in tensors) or not envvars.switch("M2OPS_CHECK_VALUES", True):
        return False
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_values(seq_idx, cu_seqlens, seqlen):
    """seq_idx must not decrease along seqlen; cu_seqlens must run from 0 to seqlen, strictly increasing;
    given both, seq_idx must number the sequences of cu_seqlens 0, 1, 2, ..."""
    if seq_idx is not None and seqlen > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        _fail(ValueError, "seq_idx", "non-decreasing along seqlen (one id per packed sequence)",
              "a decreasing step")
    if cu_seqlens is None:
        return
    cu = cu_seqlens.cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != seqlen or bool((cu[1:] <= cu[:-1]).any()):
        _fail(ValueError, "cu_seqlens", f"strictly increasing from 0 to seqlen={seqlen}", cu.tolist())
    if seq_idx is not None:
        expected = seq_idx_from_cu_seqlens(cu, seqlen)
        if not torch.equal(seq_idx.cpu().long(), expected.long()):
            _fail(ValueError, "seq_idx", "the sequence number of each token under cu_seqlens (0, 1, 2, ...)",
                  "ids that do not match cu_seqlens")


def seq_idx_from_cu_seqlens(cu_seqlens, seqlen):
    """(1, seqlen) int32 sequence number of every token; traceable (no host copy)."""
    pos = torch.arange(seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32).unsqueeze(0)
