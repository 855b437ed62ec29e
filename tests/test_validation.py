"""Every bad input raises ValueError or TypeError, and the message names the offending argument."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch

from conftest import Dims, make_inputs
from m2ops import mamba_chunk_scan_combined

ARG_NAMES = ("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens",
             "dt_softplus", "dt_limit", "return_final_states", "return_varlen_states")
b, T, h, p, g, n = 2, 20, 4, 3, 2, 5
DIMS = Dims(b, T, h, p, g, n)


def valid(batch=b, varlen=False, seq_idx=True):
    kw = make_inputs(DIMS.but(batch=batch), dtype=torch.float32, D="h", z=True, dt_bias=True, initial_states=True,
                     seq_idx=seq_idx, cu_seqlens=varlen, nseqs=3)
    return dict(kw, chunk_size=8)


def first_named_argument(message):
    """The argument name that occurs first in the message (as a whole word)."""
    found = [(m.start(), name) for name in ARG_NAMES
             for m in re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", message)]
    return min(found)[1] if found else None


def check_raises(kwargs, exc, names):
    with pytest.raises(exc) as info:
        mamba_chunk_scan_combined(**kwargs)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    names = (names,) if isinstance(names, str) else names
    assert first_named_argument(message) in names, message
    if "seq_idx" not in names and kwargs.get("seq_idx") is not None and kwargs.get("cu_seqlens") is None:
        check_raises_past_kept_plans(dict(kwargs, seq_idx=None), exc, names)


def check_raises_past_kept_plans(kwargs, exc, names):
    """The same bad call, without seq_idx (the calls whose plans are kept), while planned.CALL_PLANS holds the keys
    of valid calls that differ from it in one argument: its key (eager.call_key) must match none of them, so it
    never skips the checks that raise (eager.remembered_call, m2ops/ops/eager.py)."""
    pytest.importorskip("cuda.tile", reason="the kept plans live in m2ops.kernels.planned")
    from m2ops.kernels import planned
    from m2ops.ops import eager
    kept = {}
    for flag in (False, True):
        good = dict(valid(batch=kwargs["x"].shape[0] if isinstance(kwargs.get("x"), torch.Tensor) and
                          kwargs["x"].dim() == 4 else b, seq_idx=False), return_final_states=flag)
        call = inspect.signature(mamba_chunk_scan_combined).bind(**good)
        call.apply_defaults()
        key = eager.call_key(**call.arguments, first=True)
        assert key is not None
        kept[key] = "plan"
    saved = dict(planned.CALL_PLANS)
    planned.CALL_PLANS.clear()
    planned.CALL_PLANS.update(kept)
    real = eager.remembered_call
    try:
        def remembered(key, *args):
            assert key not in kept, f"a bad call matched a valid call's key: {kwargs}"
            return real(key, *args)
        eager.remembered_call = remembered
        with pytest.raises(exc) as info:
            mamba_chunk_scan_combined(**kwargs)
    finally:
        eager.remembered_call = real
        planned.CALL_PLANS.clear()
        planned.CALL_PLANS.update(saved)
    assert type(info.value) is exc and first_named_argument(str(info.value)) in names, str(info.value)


def randn(*shape):
    return torch.randn(*shape)


def test_valid_inputs_pass():
    """The baselines the cases below break are themselves valid."""
    mamba_chunk_scan_combined(**valid(), return_final_states=True)
    mamba_chunk_scan_combined(**valid(batch=1, varlen=True), return_varlen_states=True)
    mamba_chunk_scan_combined(**valid(batch=1, varlen=True, seq_idx=False), return_varlen_states=True)


# ---------------------------------------------------------------------------------------------------------
# shapes (ValueError)
# ---------------------------------------------------------------------------------------------------------

SHAPES = [
    ("x", "3d", randn(b, T, h)),
    ("x", "5d", randn(b, T, h, p, 1)),
    ("x", "empty_seqlen", randn(b, 0, h, p)),
    ("x", "empty_headdim", randn(b, T, h, 0)),
    ("dt", "nheads", randn(b, T, h + 1)),
    ("dt", "seqlen", randn(b, T + 1, h)),
    ("dt", "batch", randn(b + 1, T, h)),
    ("dt", "2d", randn(b, T)),
    ("A", "nheads", randn(h + 1)),
    ("A", "2d", randn(h, 1)),
    ("A", "scalar", torch.tensor(-1.0)),
    ("B", "seqlen", randn(b, T + 1, g, n)),
    ("B", "batch", randn(b + 1, T, g, n)),
    ("B", "3d", randn(b, T, g * n)),
    ("B", "zero_dstate", randn(b, T, g, 0)),
    ("C", "dstate", randn(b, T, g, n + 1)),
    ("C", "ngroups", randn(b, T, 1, n)),
    ("C", "seqlen", randn(b, T - 1, g, n)),
    ("D", "nheads", randn(h + 1)),
    ("D", "headdim", randn(h, p + 1)),
    ("D", "transposed", randn(p, h)),
    ("D", "3d", randn(1, h, p)),
    ("z", "headdim", randn(b, T, h, p + 1)),
    ("z", "seqlen", randn(b, T + 1, h, p)),
    ("z", "3d", randn(b, T, h)),
    ("dt_bias", "nheads", randn(h + 1)),
    ("dt_bias", "2d", randn(1, h)),
    ("initial_states", "dstate", randn(b, h, p, n + 1)),
    ("initial_states", "batch", randn(b + 1, h, p, n)),
    ("initial_states", "headdim", randn(b, h, p + 1, n)),
    ("initial_states", "3d", randn(b, h, p)),
    ("seq_idx", "seqlen", torch.zeros(b, T + 1, dtype=torch.int32)),
    ("seq_idx", "1d", torch.zeros(T, dtype=torch.int32)),
    ("seq_idx", "3d", torch.zeros(b, T, 1, dtype=torch.int32)),
]


@pytest.mark.parametrize("name,what,bad", SHAPES, ids=[f"{a}-{w}" for a, w, _ in SHAPES])
def test_wrong_shape(name, what, bad):
    check_raises(dict(valid(), **{name: bad}), ValueError, name)


def test_ngroups_not_dividing_nheads():
    kw = valid()
    kw["B"], kw["C"] = randn(b, T, 3, n), randn(b, T, 3, n)
    check_raises(kw, ValueError, "B")


@pytest.mark.parametrize("bad", [torch.zeros(2, T + 1, dtype=torch.int64), torch.tensor([0], dtype=torch.int64)],
                         ids=["2d", "one_entry"])
def test_cu_seqlens_wrong_shape(bad):
    check_raises(dict(valid(batch=1, seq_idx=False), cu_seqlens=bad), ValueError, "cu_seqlens")


# ---------------------------------------------------------------------------------------------------------
# dtypes and non-tensors (TypeError)
# ---------------------------------------------------------------------------------------------------------

def _as(name, dtype):
    t = valid()[name]
    return t.to(dtype)


DTYPES = [
    ("x", torch.int32), ("x", torch.int64), ("x", torch.bool), ("x", torch.complex64),
    ("dt", torch.int64), ("A", torch.int32), ("B", torch.int32), ("C", torch.int64), ("D", torch.int32),
    ("z", torch.int32), ("dt_bias", torch.int64), ("initial_states", torch.int32), ("dt", torch.complex64),
    ("seq_idx", torch.float32), ("seq_idx", torch.float64), ("seq_idx", torch.int16), ("seq_idx", torch.uint8),
    ("seq_idx", torch.bool),
]


@pytest.mark.parametrize("name,dtype", DTYPES, ids=[f"{a}-{str(d)[6:]}" for a, d in DTYPES])
def test_wrong_dtype(name, dtype):
    check_raises(dict(valid(), **{name: _as(name, dtype)}), TypeError, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_cu_seqlens_wrong_dtype(dtype):
    kw = valid(batch=1, varlen=True, seq_idx=False)
    check_raises(dict(kw, cu_seqlens=kw["cu_seqlens"].to(dtype)), TypeError, "cu_seqlens")


NON_TENSORS = [
    ("x", lambda kw: kw["x"].tolist()),
    ("x", lambda kw: kw["x"].numpy()),
    ("x", lambda kw: None),
    ("dt", lambda kw: 0.5),
    ("dt", lambda kw: None),
    ("A", lambda kw: kw["A"].tolist()),
    ("A", lambda kw: -1.0),
    ("B", lambda kw: None),
    ("B", lambda kw: kw["B"].numpy()),
    ("C", lambda kw: None),
    ("D", lambda kw: kw["D"].tolist()),
    ("D", lambda kw: 1.0),
    ("z", lambda kw: kw["z"].numpy()),
    ("dt_bias", lambda kw: 0.1),
    ("initial_states", lambda kw: kw["initial_states"].tolist()),
    ("seq_idx", lambda kw: kw["seq_idx"].tolist()),
    ("seq_idx", lambda kw: np.asarray(kw["seq_idx"])),
]


@pytest.mark.parametrize("name,make", NON_TENSORS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(NON_TENSORS)])
def test_non_tensor(name, make):
    kw = valid()
    check_raises(dict(kw, **{name: make(kw)}), TypeError, name)


def test_cu_seqlens_non_tensor():
    check_raises(dict(valid(batch=1, seq_idx=False), cu_seqlens=[0, 5, T]), TypeError, "cu_seqlens")


@pytest.mark.parametrize("chunk_size,exc", [(16.0, TypeError), ("16", TypeError), (True, TypeError),
                                             (None, TypeError), ([16], TypeError), (0, ValueError),
                                             (-16, ValueError)],
                         ids=["float", "str", "bool", "none", "list", "zero", "negative"])
def test_bad_chunk_size(chunk_size, exc):
    check_raises(dict(valid(), chunk_size=chunk_size), exc, "chunk_size")


@pytest.mark.parametrize("name,value", [("dt_softplus", 1), ("dt_softplus", "yes"), ("dt_softplus", None),
                                        ("dt_softplus", [True]), ("return_final_states", 1),
                                        ("return_final_states", None), ("return_final_states", {}),
                                        ("return_varlen_states", "no")])
def test_bad_flags(name, value):
    check_raises(dict(valid(), **{name: value}), TypeError, name)


@pytest.mark.parametrize("dt_limit", [0.5, (0.1,), (0.0, 1.0, 2.0), ("0", 1.0), None, ([0.0], 1.0), (0.0, {})],
                         ids=["scalar", "one", "three", "str", "none", "list_min", "dict_max"])
def test_dt_limit_type(dt_limit):
    check_raises(dict(valid(), dt_limit=dt_limit), TypeError, "dt_limit")


@pytest.mark.parametrize("dt_limit", [(1.0, 0.5), (float("nan"), 1.0), (0.0, float("nan")), (float("inf"), 0.0)],
                         ids=["min_gt_max", "nan_min", "nan_max", "inf_min"])
def test_dt_limit_values(dt_limit):
    check_raises(dict(valid(), dt_limit=dt_limit), ValueError, "dt_limit")


def test_dt_limit_equal_bounds_allowed():
    mamba_chunk_scan_combined(**dict(valid(), dt_limit=(0.5, 0.5)))


# ---------------------------------------------------------------------------------------------------------
# devices: "meta" as the second device
# ---------------------------------------------------------------------------------------------------------

DEVICE_ARGS = ["dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx"]


@pytest.mark.parametrize("name", DEVICE_ARGS)
def test_mismatched_device(name):
    kw = valid()
    check_raises(dict(kw, **{name: kw[name].to("meta")}), ValueError, name)


def test_cu_seqlens_mismatched_device():
    kw = valid(batch=1, varlen=True, seq_idx=False)
    check_raises(dict(kw, cu_seqlens=kw["cu_seqlens"].to("meta")), ValueError, "cu_seqlens")


def test_x_on_other_device():
    """x on meta, the rest on the CPU: the first argument off x's device is named."""
    kw = valid()
    check_raises(dict(kw, x=kw["x"].to("meta")), ValueError, "dt")


# ---------------------------------------------------------------------------------------------------------
# values of seq_idx and cu_seqlens (ValueError)
# ---------------------------------------------------------------------------------------------------------

def test_decreasing_seq_idx():
    kw = valid()
    s = torch.zeros(b, T, dtype=torch.int32)
    s[1, 5:] = 2
    s[1, 12:] = 1
    check_raises(dict(kw, seq_idx=s), ValueError, "seq_idx")


def _cu(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("cu", [[1, 5, T], [0, 5, T - 1], [0, 5, T + 1], [0, 5, 5, T], [0, 9, 5, T], [0, 0, T],
                                [-1, 5, T]],
                         ids=["not_from_0", "short_end", "long_end", "repeated", "decreasing", "empty_first",
                              "negative"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_bad_cu_seqlens(cu, dtype):
    check_raises(dict(valid(batch=1, seq_idx=False), cu_seqlens=_cu(cu, dtype)), ValueError, "cu_seqlens")


def test_cu_seqlens_with_batch_above_1():
    check_raises(dict(valid(), cu_seqlens=_cu([0, 5, T])), ValueError, ("cu_seqlens", "x"))


@pytest.mark.parametrize("seq", ["shifted_boundary", "offset_ids", "one_sequence"])
def test_cu_seqlens_not_matching_seq_idx(seq):
    kw = valid(batch=1, varlen=True, seq_idx=True)
    cu = kw["cu_seqlens"]
    s = kw["seq_idx"].clone()
    if seq == "shifted_boundary":
        k = int(cu[1])
        s[0, k - 1] = s[0, k]  # the first sequence ends one token early
    elif seq == "offset_ids":
        s = s + 1
    else:
        s = torch.zeros_like(s)
    check_raises(dict(kw, seq_idx=s), ValueError, ("seq_idx", "cu_seqlens"))


def test_return_varlen_states_without_cu_seqlens():
    check_raises(dict(valid(), return_varlen_states=True), ValueError, "cu_seqlens")
