"""Input validation of m2ops.mamba_chunk_scan_combined_varlen (the packed 3-D form serving engines hold): every
error names the argument and what was expected, and is raised before anything is written.

check_varlen_inputs reads shapes, dtypes and devices only (free, traceable). check_cu_seqlens_values and
check_state_slots read tensor contents: the public function runs them in eager mode when no VarlenMeta is given
(prepare_varlen checked cu_seqlens once on the host), state_slots' also where they are on the CPU.
"""

from __future__ import annotations

import torch

from .validate import FLOAT_DTYPES, INDEX_DTYPES, _device, _fail, _shape, _tensor

WHERE = "m2ops.mamba_chunk_scan_combined_varlen"


def _written(name, t):
    """A tensor written in place must not be an expanded view (its elements would share memory)."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        _fail(ValueError, name, "a tensor whose elements do not share memory (it is written in place)",
              f"an expanded view of strides {tuple(t.stride())}", WHERE)


def check_varlen_inputs(x, dt, B, C, z, cu_seqlens, initial_states, out, state_dtype, state_cache, state_slots,
                        has_initial_state, meta):
    """The packed form's own rules: x (total_tokens, nheads, headdim), dt (total_tokens, nheads), B/C/z, the
    per-sequence arguments, out and the state cache. (The rest, shared with mamba_chunk_scan_combined, is
    check_inputs' on the batch-1 views.) Returns num_sequences."""
    w = WHERE
    _tensor("x", x, FLOAT_DTYPES, "floating", w)
    if x.dim() != 3:
        _fail(ValueError, "x", "3-dimensional (total_tokens, nheads, headdim)", tuple(x.shape), w)
    T, h, p = x.shape
    if T < 1 or h < 1 or p < 1:
        _fail(ValueError, "x", "non-empty in every dimension (total_tokens, nheads, headdim)", tuple(x.shape), w)
    _tensor("dt", dt, FLOAT_DTYPES, "floating", w)
    _shape("dt", dt, (T, h), "(total_tokens, nheads)", w)
    _tensor("B", B, FLOAT_DTYPES, "floating", w)
    if B.dim() != 3 or B.shape[0] != T:
        _fail(ValueError, "B", f"of shape (total_tokens, ngroups, dstate) = ({T}, ngroups, dstate)", tuple(B.shape), w)
    g, n = B.shape[1], B.shape[2]
    if g < 1 or n < 1 or h % g != 0:
        _fail(ValueError, "B", f"of shape (total_tokens, ngroups, dstate) with ngroups dividing nheads={h} and "
              "dstate >= 1", tuple(B.shape), w)
    _tensor("C", C, FLOAT_DTYPES, "floating", w)
    _shape("C", C, (T, g, n), "(total_tokens, ngroups, dstate) like B", w)
    if z is not None:
        _tensor("z", z, FLOAT_DTYPES, "floating", w)
        _shape("z", z, (T, h, p), "(total_tokens, nheads, headdim) like x", w)

    if cu_seqlens is None:
        if meta is None:
            _fail(TypeError, "cu_seqlens", "a tensor (num_sequences + 1,) (or a VarlenMeta as meta)", None, w)
        cu_seqlens = meta.cu_seqlens
    _tensor("cu_seqlens", cu_seqlens, INDEX_DTYPES, "integer", w)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        _fail(ValueError, "cu_seqlens", "1-dimensional (num_sequences + 1,) with at least 2 entries",
              tuple(cu_seqlens.shape), w)
    nseq = cu_seqlens.shape[0] - 1
    if meta is not None:  # (a VarlenMeta: the public function checked its type)
        if meta.num_sequences != nseq or meta.total_tokens != T:
            _fail(ValueError, "meta", f"prepared for cu_seqlens of {nseq} sequences ending at total_tokens={T} "
                  "(m2ops.prepare_varlen on this batch's cu_seqlens)",
                  f"{meta.num_sequences} sequences of {meta.total_tokens} tokens", w)
        _device("meta", meta.seq_idx, x.device, w)

    if initial_states is not None:
        _tensor("initial_states", initial_states, FLOAT_DTYPES, "floating", w)
        _shape("initial_states", initial_states, (nseq, h, p, n), "(num_sequences, nheads, headdim, dstate)", w)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail(TypeError, "out", "a torch.Tensor", type(out).__name__, w)
        if out.dtype != x.dtype:
            _fail(TypeError, "out", f"of x's dtype ({x.dtype})", out.dtype, w)
        _shape("out", out, (T, h, p), "(total_tokens, nheads, headdim) like x", w)
        _written("out", out)
    if state_dtype is not None and state_dtype not in FLOAT_DTYPES:
        _fail(TypeError, "state_dtype", f"None or a floating dtype ({', '.join(str(d) for d in FLOAT_DTYPES)})",
              state_dtype, w)
    if (state_cache is None) != (state_slots is None):
        _fail(ValueError, "state_slots" if state_slots is None else "state_cache",
              "given together with " + ("state_cache" if state_slots is None else "state_slots"), None, w)
    if state_cache is not None:
        _tensor("state_cache", state_cache, FLOAT_DTYPES, "floating", w)
        if state_cache.dim() != 4 or tuple(state_cache.shape[1:]) != (h, p, n) or state_cache.shape[0] < 1:
            _fail(ValueError, "state_cache", f"of shape (cache_rows, nheads, headdim, dstate) = (cache_rows, {h}, {p}, "
                  f"{n}) with cache_rows >= 1", tuple(state_cache.shape), w)
        _written("state_cache", state_cache)
        _tensor("state_slots", state_slots, INDEX_DTYPES, "integer", w)
        _shape("state_slots", state_slots, (nseq,), "(num_sequences,)", w)
    if has_initial_state is not None:
        _tensor("has_initial_state", has_initial_state, (torch.bool,), "bool", w)
        _shape("has_initial_state", has_initial_state, (nseq,), "(num_sequences,)", w)
        if initial_states is None and state_cache is None:
            _fail(ValueError, "has_initial_state", "given with initial_states or with state_cache and state_slots "
                  "(where the start states are read)", None, w)
    for name, t in (("dt", dt), ("B", B), ("C", C), ("z", z), ("cu_seqlens", cu_seqlens),
                    ("initial_states", initial_states), ("out", out), ("state_cache", state_cache),
                    ("state_slots", state_slots), ("has_initial_state", has_initial_state)):
        if t is not None:
            _device(name, t, x.device, w)
    return nseq


def check_cu_seqlens_values(cu_seqlens, total_tokens):
    """cu_seqlens must run from 0 to total_tokens, strictly increasing (reads the values: a host copy)."""
    cu = cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.shape[0] < 2:
        _fail(ValueError, "cu_seqlens", "1-dimensional (num_sequences + 1,) with at least 2 entries", tuple(cu.shape),
              WHERE)
    if int(cu[0]) != 0 or int(cu[-1]) != total_tokens or bool((cu[1:] <= cu[:-1]).any()):
        _fail(ValueError, "cu_seqlens", f"strictly increasing from 0 to total_tokens={total_tokens}", cu.tolist(),
              WHERE)


def check_state_slots(state_slots, cache_rows):
    """Each slot in [0, cache_rows) and distinct (two sequences must not write one cache row); reads the values."""
    slots = state_slots.cpu()
    if bool(((slots < 0) | (slots >= cache_rows)).any()):
        bad = slots[(slots < 0) | (slots >= cache_rows)][0]
        _fail(ValueError, "state_slots", f"in [0, cache_rows) = [0, {cache_rows}) (state_cache.shape[0])",
              f"the value {int(bad)}", WHERE)
    if slots.unique().numel() != slots.numel():
        _fail(ValueError, "state_slots", "distinct (one sequence per cache row)", "a repeated slot", WHERE)
