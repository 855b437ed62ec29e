"""The eager forward planned once per signature: a ForwardPlan holds everything chunk_cumsum and chunk_scan's
two-op path decide from sizes, dtypes and options (the tuned configuration, the three launchers' plans, one
scratch allocation's layout), so that a repeated call only takes its scratch and launches. The same run_*
functions as the launchers (forward.py) do the launching, so the results are the launchers' bits.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import torch

from .. import envvars
from ..meta.shapes import cumsum_shape, num_chunks
from . import autotune, config, runtime
from ..meta.shapes import KERNEL_DTYPES
from .common import cdiv
from .forward import cb_programs, cumsum_plan, out_plan, run_cumsum, run_out, run_states, state_plan
from .runtime import Step, d_arg, dtype_name, dummy, stream_handle
from . import scan
from .scan import chunk_scan_shape_key, scan_entering_dtype


# The public function's eager path (m2ops/ops/eager.py) calls chunk_cumsum and then chunk_scan, and each
# launcher re-derives on every call what the inputs' sizes, dtypes and options decide: the dtypes to convert to,
# the tuned configuration, the plans. A ForwardPlan keeps all of it for one signature, so that a repeated call
# only allocates its buffers and launches its five kernels, through the same run_* functions as the launchers.
# Two more host costs go (v23): the five scratch buffers come from one allocation (torch.empty cost the H200's
# host 5-9 us each), and each launch takes the kernel (64- or 32-bit-indexed) its first call resolved, since
# the plan's arrays have the same sizes and layouts on every call.

_SCRATCH_ALIGN = 512  # bytes: the caching allocator's own alignment, so each view starts as a fresh tensor would


class Resolved:
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
        runtime.launch(step.grid, step.kernel, arrays + step.tail, step.pdl, arrays, slot)


def scratch_layout(specs) -> tuple:
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


def scratch_views(layout, total, device) -> tuple:
    """The buffers of scratch_layout, as views of one fresh allocation: one dtype view of it per dtype, then an
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
# eager call waits on the host: measure/scratch_keep.py, docs/history.md v33). Safe because the kernels of consecutive calls on one stream run in order (PDL
# only overlaps a kernel's launch: every forward kernel waits for the one before it before any load or store),
# and nothing outside the call ever sees the scratch (y and the final states are fresh each call). Per thread,
# since two threads issuing on one stream would interleave their launches. Never under CUDA-graph capture (a
# graph would bake in the kept buffers, which later eager calls overwrite). Least recently used entries go once
# the kept total passes M2OPS_SCRATCH_KEEP_MB (default 64; 0 keeps none).
SCRATCH_KEEP_BYTES = envvars.mebibytes("M2OPS_SCRATCH_KEEP_MB", 64)


# (id of the layout, stream, thread) -> (layout, views, bytes), least recently used first
_KEPT_SCRATCH: collections.OrderedDict = collections.OrderedDict()


_KEPT_LOCK = threading.Lock()


def planned_scratch(fp, device) -> tuple:
    """fp's scratch views: the kept ones for this stream and thread where allowed (above), else fresh."""
    if (device.type != "cuda" or fp.scratch_bytes > SCRATCH_KEEP_BYTES
            or torch._C._cuda_isCurrentStreamCapturing()):
        return scratch_views(fp.scratch, fp.scratch_bytes, device)
    key = (id(fp.scratch), stream_handle(), threading.get_ident())
    with _KEPT_LOCK:
        got = _KEPT_SCRATCH.get(key)
        # (the entry holds its layout, so its id names no other layout while it is kept)
        if got is not None and got[0] is fp.scratch:
            _KEPT_SCRATCH.move_to_end(key)
            return got[1]
    views = scratch_views(fp.scratch, fp.scratch_bytes, device)
    with _KEPT_LOCK:
        _KEPT_SCRATCH[key] = (fp.scratch, views, fp.scratch_bytes)
        total = sum(v[2] for v in _KEPT_SCRATCH.values())
        while total > SCRATCH_KEEP_BYTES:
            _, (_, _, nbytes) = _KEPT_SCRATCH.popitem(last=False)
            total -= nbytes
    return views


def kept_scratch_bytes() -> int:
    """Bytes of scratch kept between planned calls now (planned_scratch)."""
    with _KEPT_LOCK:
        return sum(v[2] for v in _KEPT_SCRATCH.values())


class ForwardPlan(NamedTuple):
    tune_key: object      # chunk_scan's tuning-cache key (None for an untuned call: CPU tensors)
    candidates: tuple     # chunk_scan's candidate configurations (a stored one outside them is ignored)
    config: dict          # chunk_scan's configuration when the plan was made
    from_default: bool    # config was the default because the cache had no entry (tuning off)
    cumsum: Step
    cumsum_shape: tuple
    states: object        # StatePlan
    entering_dtype: object  # the separate entering states' dtype, or None
    out: object           # OutPlan (None: no plan for this signature, take the launchers)
    scratch: tuple = ()   # scratch_layout of dt_out, dA_cumsum, local states, entering states (or None), cb
    scratch_bytes: int = 0
    go: object = None     # Resolved


def forward_plan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max):
    """The ForwardPlan of a forward without seq_idx on these inputs (validated, contiguous), or None for now:
    CUDA-graph capture is on, or chunk_scan's tuning may still search this shape.
    A plan whose `out` is None says the call must take the launchers one by one: inputs the kernels take only
    after a conversion (other dtypes, or x, B, C, z of different dtypes), or chunk_scan's fused path as the
    configuration. A configuration at another chunk size (sub- or super-chunks) is planned at that chunk size
    throughout, chunk_cumsum included: the launchers' path, which receives chunk_cumsum's output at the caller's
    chunk size, re-cuts it with `rechunk` (several PyTorch operations), so the two agree up to the rounding of the
    cumulative sums."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L, dev, cfg = chunk_size, x.device, config.current()
    none = ForwardPlan(None, (), {}, False, None, (), None, None, None)
    if (x.dtype not in KERNEL_DTYPES or dt.dtype not in KERNEL_DTYPES
            or B.dtype != x.dtype or C.dtype != x.dtype or (z is not None and z.dtype != x.dtype)
            or any(t is not None and t.dtype != torch.float32 for t in (A, D, dt_bias, initial_states))):
        return none
    default, candidates = scan.kept_scan_configs(b, T, h, p, n, L, dev)
    tune_key, choice, from_default = None, default, False
    if scan.tuned(x):
        tune_key = autotune.full_key("chunk_scan", chunk_scan_shape_key(x, L, B, z, D, None), dev.index or 0,
                                     candidates=candidates)
        found = autotune.lookup(tune_key, candidates)
        if found is None and autotune.enabled():
            return None  # the launchers' path may search now
        choice, from_default = (default, True) if found is None else (found, False)
    sub = choice.get("chunk", L)
    if choice["path"] != "split" or (L % sub and sub % L):
        return none._replace(tune_key=tune_key, candidates=candidates, config=choice, from_default=from_default)
    dname = dtype_name(x.dtype)
    entering = scan_entering_dtype(x.dtype)
    states = state_plan(b, T, h, p, g, n, sub, dname, False, initial_states is not None, choice.get("state_block"),
                         entering is not None, entering, dev)
    _, has_d = d_arg(D, x)
    out = out_plan(b, T, h, p, g, n, sub, dname, False, entering if entering is not None else states.local_dtype,
                    has_d, z is not None, dev)
    if (entering is not None) != out.states_bf16:
        return none  # compute_out would convert the states first
    dt_args = ((dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max))
               if cfg.fused_cumsum and num_chunks(T, sub) <= cfg.fused_cumsum_max_chunks and dt.dtype in (torch.float32, x.dtype) else None)
    if dt_args is not None:
        states = state_plan(b, T, h, p, g, n, sub, dname, False, initial_states is not None,
                             choice.get("state_block"), entering is not None, entering, dev, cb_programs(out),
                             dt_args)
    cumsum = cumsum_plan(b, T, h, sub, dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max), dev)
    cs_shape = cumsum_shape(b, T, h, sub)
    layout, nbytes = scratch_layout(((torch.float32, cs_shape), (torch.float32, cs_shape),
                                      (states.local_dtype, states.states_shape),
                                      (entering, states.states_shape) if states.separate else None,
                                      (out.cb_dtype, out.cb_shape)))
    return ForwardPlan(tune_key, candidates, choice, from_default, cumsum, cs_shape, states, entering, out, layout,
                       nbytes, Resolved())


def forward_plan_current(fp: ForwardPlan) -> bool:
    """Whether chunk_scan would still choose fp's configuration: the tuning cache's entry for its key is the one
    the plan was made with, or, for a plan made on the default, there is still none and tuning is still off."""
    if fp.tune_key is None:
        return True
    found = autotune.lookup(fp.tune_key, fp.candidates)
    if found is None:
        return fp.from_default and not autotune.enabled()
    return found == fp.config


FORWARD_PLANS: dict = {}


def planned_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max,
                    call_key=None):
    """y and the final states of a forward without seq_idx, through this signature's ForwardPlan; None where the
    call must take the launchers: no plan; the profiler on (the launchers then run inside record_functions named
    after their ops); an input not contiguous. Inputs as the
    public function passes them, validated. call_key (the public call's, m2ops/ops/eager.py call_key): the plan
    is also kept under it in CALL_PLANS, for the next call with that key to go to it directly."""
    if torch.autograd._profiler_enabled():
        return None
    if not all(t is None or t.is_contiguous() for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)):
        return None
    sig = (x.shape, B.shape, x.device, x.dtype, dt.dtype, A.dtype, B.dtype, C.dtype,
           None if D is None else (D.shape, D.dtype), None if z is None else z.dtype,
           None if dt_bias is None else dt_bias.dtype, None if initial_states is None else initial_states.dtype,
           chunk_size, bool(dt_softplus), dt_min, dt_max, config.current())
    fp = FORWARD_PLANS.get(sig)
    if fp is None or not forward_plan_current(fp):
        fp = forward_plan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_min, dt_max)
        if fp is None:
            FORWARD_PLANS.pop(sig, None)
            return None
        if len(FORWARD_PLANS) >= 1024:
            FORWARD_PLANS.clear()
        FORWARD_PLANS[sig] = fp
    if fp.out is None:
        return None
    if call_key is not None:
        if len(CALL_PLANS) >= 1024:
            CALL_PLANS.clear()
        CALL_PLANS[call_key] = fp
    return run_forward(fp, x, dt, A, B, C, D, z, dt_bias, initial_states)


# The public call's own key (eager.call_key: its arguments' types, sizes, dtypes, devices, layouts and plain
# values, with config.current()) -> the ForwardPlan a validated call with that key ran, kept by planned_forward. A
# repeated call finds its plan here before any check, lookup or dispatch (eager.remembered_call).
CALL_PLANS: dict = {}


def run_forward(fp: ForwardPlan, x, dt, A, B, C, D, z, dt_bias, initial_states):
    """y and the final states of chunk_cumsum and chunk_scan's two-op path, by fp (whose out is not None): the
    same launches, buffers and bits as the launchers give (with a configuration at another chunk size, those of the
    launchers called at that chunk size: forward_plan)."""
    dt_out, dA_cumsum, local, entering, cb = planned_scratch(fp, x.device)
    go = fp.go
    bias = dt_bias if dt_bias is not None else A
    if not fp.states.fused_cumsum:
        run_cumsum(fp.cumsum, fp.cumsum_shape, dt, A, bias, (dt_out, dA_cumsum), go)
    seq = dummy(x, torch.int32, 2)
    states, final_states = run_states(fp.states, fp.entering_dtype, x, B, dt_out, dA_cumsum, seq, initial_states,
                                       (local, entering), go, (C, cb), (dt, A, bias))
    y = run_out(fp.out, x, dt_out, dA_cumsum, C, B, states, d_arg(D, x)[0], z if z is not None else x, seq, cb,
                 go, fp.states.fused_cumsum)
    return y, final_states


def _forget() -> None:
    FORWARD_PLANS.clear()
    CALL_PLANS.clear()
    with _KEPT_LOCK:
        _KEPT_SCRATCH.clear()


runtime.on_clear(_forget)
