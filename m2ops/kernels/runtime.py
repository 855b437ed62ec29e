"""The launch runtime every launcher shares: converting arguments to the kernels' form, one-element stand-ins for
absent inputs, the launch itself (the 32-bit-indexed twin where the arrays fit, programmatic dependent launch) and
plans kept per signature.

Inputs are read in place through their strides (any layout, no padding copies), with these exceptions, each one
copy of a small or rare tensor: A, dt_bias, D and initial_states are converted to float32 when they are not;
seq_idx and cu_seqlens to int32 when they are int64; when x, B, C (and z) differ in dtype they are converted to
their promoted dtype (and y back); a tensor with a zero stride over a dimension longer than one (an expanded
view) is made contiguous, because the kernels assume distinct indices address distinct elements.

launch and sm_count are looked up on this module at each call (runtime.launch(...)): the CPU emulator of the
tests replaces them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

import cuda.tile as ct

from . import config, index_width, registry


def dense(t):
    """t itself unless a dimension longer than one has stride 0 (an expanded view). The contiguous case, by
    far the most common, is decided by one C call: this runs for every array of every launch."""
    if t.is_contiguous():
        return t
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def as_dtype(t, dtype):
    return dense(t if t.dtype == dtype else t.to(dtype))


def param_dtype(act_dtype, *params):
    """The dtype a kernel reads its small parameter arrays (weights, biases) in: the activations' when every given
    one already is (no conversion: a decode step would otherwise launch one per parameter per token), else
    float32 (the kernels compute in float32 either way). The specialisations list both (specs.PARAM_KERNELS)."""
    given = [p for p in params if p is not None]
    return act_dtype if given and all(p.dtype == act_dtype for p in given) else torch.float32


_DUMMIES: dict = {}


def dummy(ref_tensor, dtype, ndim):
    """A one-element array for a parameter whose input is absent; the kernel never reads or writes it. One per
    (device, dtype, ndim), kept: an allocation costs the host 5-6 us on the H200's machine
    (measure/launch_cost.py), and a forward passes two or three. Not kept when made inside CUDA-graph
    capture (it would come from the graph's private pool)."""
    key = (ref_tensor.device, dtype, ndim)
    t = _DUMMIES.get(key)
    if t is None:
        t = torch.empty((1,) * ndim, dtype=dtype, device=ref_tensor.device)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DUMMIES[key] = t
    return t


def d_arg(D, like):
    """(array, has_d) of D as compute_out, segment_out and state_update read it: has_d 0 absent (a dummy), 1 one
    value per head as a float32 (nheads, 1) view, 2 float32 (nheads, headdim)."""
    if D is None:
        return dummy(like, torch.float32, 2), 0
    if D.dim() == 2 and D.shape[1] > 1 and D.stride(1) == 0:
        D = D[:, 0]  # one value per head broadcast along headdim (mamba_ssm's decode form): no copy per call
    Dk = as_dtype(D, torch.float32)
    return (Dk.unsqueeze(1), 1) if Dk.dim() == 1 else (Dk, 2)


def d_per_channel(D, nheads, headdim, like):
    """D as the float32 (nheads, headdim) array the backward's kernels read (a dummy when D is None)."""
    Dk, has_d = d_arg(D, like)
    return Dk.expand(nheads, headdim).contiguous() if has_d else Dk


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def stream_handle() -> int:
    """The current CUDA stream's raw handle, from two C calls: torch.cuda.current_stream() builds a Stream
    object through several Python frames, a measurable share of the host time of a call that launches 5-17
    kernels (measure/host_scan.py). ct.launch takes the handle as an int."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


_PDL_DEVICE: dict = {}


def uses_pdl(kernel) -> bool:
    """Whether kernel is launched with programmatic dependent launch: a PDL kernel of the registry, PDL on, and a
    GPU of compute capability 9.0 or later."""
    if not config.current().pdl or kernel._pyfunc.__name__ not in registry.PDL_FUNCTIONS:
        return False
    index = torch._C._cuda_getDevice()
    if index not in _PDL_DEVICE:
        _PDL_DEVICE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _PDL_DEVICE[index]


def launch(grid, kernel, args, pdl=None, arrays=None, slot=None):
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
    ct.launch(stream_handle(), grid, kernel, args,
              programmatic_dependent_launch=uses_pdl(kernel) if pdl is None else pdl)


# What a launcher decides from sizes, dtypes, the options present and the device (specialisation, hints, grid,
# the scalar arguments) is worked out once per such key and kept: a call then only converts its inputs,
# allocates its outputs and launches. Working it out each call cost the H200's host about 70 us of Python per
# forward (measure/launch_cost.py), at T=16K, dstate 64 more than the GPU's time for the whole forward.
# config.current() is part of every key, so a changed knob gives new plans.

class Step(NamedTuple):
    """One planned launch: the arrays are the call's, everything else is here."""
    grid: tuple
    kernel: object  # as the launcher names it (64-bit-indexed arrays; launch takes the 32-bit twin)
    pdl: bool       # programmatic dependent launch (uses_pdl)
    tail: tuple     # the scalar arguments after the arrays

    def launch(self, arrays: tuple):
        launch(self.grid, self.kernel, arrays + self.tail, self.pdl, arrays)


def step(grid, kernel, tail, device) -> Step:
    return Step(tuple(grid), kernel, device.type == "cuda" and uses_pdl(kernel), tuple(tail))


def planned(build):
    """build (a function of hashable arguments) with its results kept per arguments and config.current()."""
    kept = functools.lru_cache(maxsize=1024)(lambda cfg, args: build(*args))

    @functools.wraps(build)
    def plan(*args):
        return kept(config.current(), args)
    _CLEARS.append(kept.cache_clear)
    return plan


_CLEARS: list = []  # what clear_plans calls: each kept plan cache's cache_clear, and planned.py's own


def on_clear(forget) -> None:
    """Have clear_plans call forget() too (a module that keeps plans of its own)."""
    _CLEARS.append(forget)


def clear_plans() -> None:
    """Forget every kept plan (after changing what sm_count returns, as the CPU emulator does)."""
    for forget in _CLEARS:
        forget()


def common_dtype(*tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype
