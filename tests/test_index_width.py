"""32-bit-indexed twins of the kernels (m2ops/kernels/index_width.py): when they are taken, and that they are
the same kernels with only the index width of their large arrays changed."""

from __future__ import annotations

import pytest
import torch

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

from m2ops.kernels import index_width, planned, registry, runtime, specialise  # noqa: E402
from knobs import knobs  # noqa: E402


def _meta(*shape):
    return torch.empty(shape, device="meta")


def test_fits_int32_at_the_boundary():
    assert index_width.fits_int32([_meta(2 ** 15, 2 ** 16)])           # last offset 2^31 - 1
    assert not index_width.fits_int32([_meta(2 ** 15, 2 ** 16 + 1)])  # last offset past it
    strided = _meta(4).as_strided((2, 2), (2 ** 31, 1))              # strides count, not numel
    assert not index_width.fits_int32([_meta(4), strided, 3, None])
    assert index_width.fits_int32([_meta(0, 2 ** 40), 1.5])


def _index_dtypes(kernel):
    ann = kernel._annotated_function
    return {p: (a.array.index_dtype if a.array is not None else ct.int32)
            for p, a in zip(ann.pysig.parameters, ann.parameter_annotations)
            if not a.constant and p in kernel._pyfunc.__annotations__}


def test_twin_indexes_in_32_bits_with_the_same_hints():
    k = specialise.hinted("compute_out", (("occupancy", 4),))
    twin = index_width.narrow_twin(k)
    assert twin is not k and index_width.narrow_twin(k) is twin
    assert twin._compiler_options == k._compiler_options
    assert twin._pyfunc.__code__ is k._pyfunc.__code__
    wide, narrow = _index_dtypes(k), _index_dtypes(twin)
    assert wide["x"] == ct.int64 and wide["states"] == ct.int64
    assert set(narrow.values()) == {ct.int32} and narrow.keys() == wide.keys()


def test_kernel_without_wide_arrays_is_its_own_twin():
    @ct.kernel
    def small(x, y):
        ct.store(y, (0,), ct.load(x, (0,), shape=(4,)))

    assert not index_width.has_wide_arrays(small)
    assert index_width.narrow_twin(small) is small


@pytest.mark.parametrize("enabled", [False, True])
def test_launch_takes_the_twin_only_when_enabled_and_fitting(monkeypatch, enabled):
    launched = []

    class Stub:
        @staticmethod
        def launch(stream, grid, kernel, args, programmatic_dependent_launch):
            assert stream == 1234  # the handle _stream_handle gives, passed through
            assert programmatic_dependent_launch == "pdl"  # _pdl's answer, passed through
            launched.append(kernel)

    monkeypatch.setattr(runtime, "ct", Stub)
    monkeypatch.setattr(runtime, "stream_handle", lambda: 1234)
    monkeypatch.setattr(runtime, "uses_pdl", lambda kernel: "pdl")
    knobs(monkeypatch, index32=enabled)
    k = registry.KERNELS["chunk_cumsum"]
    runtime.launch((1, 1, 1), k, (_meta(8, 8), 3))
    runtime.launch((1, 1, 1), k, (_meta(2 ** 16, 2 ** 16), 3))
    assert launched[1] is k
    assert launched[0] is (index_width.narrow_twin(k) if enabled else k)


def test_a_slot_keeps_the_first_choice(monkeypatch):
    """runtime.launch with a slot (a ForwardPlan's launches, planned.Resolved): the kernel for_args chose on the
    first launch is launched from then on, without looking at the arrays again."""
    launched, looked = [], []

    class Stub:
        @staticmethod
        def launch(stream, grid, kernel, args, programmatic_dependent_launch):
            launched.append(kernel)

    real = index_width.for_args
    monkeypatch.setattr(runtime, "ct", Stub)
    monkeypatch.setattr(runtime, "stream_handle", lambda: 1)
    monkeypatch.setattr(index_width, "for_args", lambda k, a: looked.append(1) or real(k, a))
    knobs(monkeypatch, index32=True)
    k = registry.KERNELS["chunk_cumsum"]
    go = planned.Resolved()
    step = runtime.Step((1, 1, 1), k, False, (3,))
    for _ in range(3):
        go(step, (_meta(8, 8),))
    assert looked == [1] and launched == [index_width.narrow_twin(k)] * 3
    other = runtime.Step((1, 1, 1), k, False, (4,))  # a step of its own: its own choice
    go(other, (_meta(2 ** 16, 2 ** 16),))
    assert looked == [1, 1] and launched[-1] is k


def test_dense_copies_only_expanded_views():
    """runtime.dense: contiguous and strided tensors pass through untouched (the kernels read strides); a view
    with stride 0 over a dimension longer than one is made contiguous (distinct indices must address
    distinct elements)."""
    t = torch.randn(4, 6)
    assert runtime.dense(t) is t
    strided = t[:, ::2]
    assert runtime.dense(strided) is strided
    single = torch.randn(4, 1).expand(4, 1)  # stride 0 only over a dimension of size one
    assert runtime.dense(single) is single
    expanded = torch.randn(4, 1).expand(4, 6)
    out = runtime.dense(expanded)
    assert out is not expanded and out.is_contiguous() and torch.equal(out, expanded)
