"""The gated RMSNorm's kernels (m2ops/kernels/norm.py: gated_norm, gated_norm_bwd) on the emulator against the
reference (m2ops/reference/gated_norm.py), on the same rounded inputs.

What the emulator catches and misses: tests/emulated_cases.py. Here: the (rows, ngroups, group_size) views with a
row stride (z as a slice of a wider buffer), padded group tiles and row blocks, every group tile class up to the
8192 tile, the backward's programs walking several row blocks (a small SM count) and the sums of their partial
rows. Tolerances: both sides compute in float32 from the same inputs and differ by summation order and the gate's
exp2 / division (about 1e-7 relative), plus one rounding of 16-bit outputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # outside the quick subset (-m "not slow")

from emulated_cases import SWEEP, rel_err  # noqa: E402
from tile_emulator import LAUNCHED, emulated_kernels  # noqa: E402

from m2ops.kernels import norm  # noqa: E402
from m2ops.reference import gated_norm as ref  # noqa: E402

TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SUM_TOL = 2e-6  # dweight, dbias: float32 sums over rows

OPTIONS = {  # name: (z given, bias given, norm_before_gate)
    "plain": (False, False, True),
    "bias": (False, True, True),
    "gate_after_bias": (True, True, True),
    "gate_after": (True, False, True),
    "gate_before": (True, False, False),
    "gate_before_bias": (True, True, False),
}


def _inputs(lead, ngroups, group_size, dtype, z, bias, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = ngroups * group_size

    def randn(*s):
        return torch.randn(*s, generator=gen)

    x = randn(*lead, hidden).to(dtype)
    zt = (2 * randn(*lead, hidden)).to(dtype) if z else None
    if layout == "slice" and zt is not None:  # the layer's z: a slice of in_proj's output, rows strided
        big = torch.zeros(*lead, 2 * hidden + 8, dtype=dtype)
        zt = big[..., 8:8 + hidden].copy_(zt)
    if layout == "transposed":  # leading dimensions that do not flatten to one row stride: copied once
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    w = 1 + 0.5 * randn(hidden)
    b = 0.3 * randn(hidden) if bias else None
    dy = randn(*lead, hidden).to(dtype)
    return x, w, b, zt, dy


def _check(lead, ngroups, group_size, dtype, name, layout, seed, sm_count):
    z, bias, nbg = OPTIONS[name]
    x, w, b, zt, dy = _inputs(lead, ngroups, group_size, dtype, z, bias, layout, seed)
    what = f"{name} {dtype} {lead} {ngroups}x{group_size} {layout}"
    ey, er = ref.rms_norm_gated(x, w, b, zt, 1e-5, group_size, nbg)
    eg = ref.rms_norm_gated_bwd(dy, x, w, b, zt, er, 1e-5, group_size, nbg)
    with emulated_kernels(sm_count=sm_count):
        y, r = norm.rms_norm_gated(x, w, b, zt, 1e-5, group_size, nbg)
        g = norm.rms_norm_gated_bwd(dy, x, w, b, zt, er, 1e-5, group_size, nbg)
    assert y.shape == ey.shape and y.dtype == ey.dtype and r.shape == er.shape and r.dtype == er.dtype, what
    assert rel_err(y, ey) <= TOL[dtype], f"{what} y: {rel_err(y, ey):.2e}"
    assert rel_err(r, er) <= TOL[torch.float32], f"{what} rstd: {rel_err(r, er):.2e}"
    for k, got, want, tol in zip(("dx", "dweight", "dbias", "dz"), g, eg, (TOL[dtype], SUM_TOL, SUM_TOL, TOL[dtype])):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), f"{what} {k}"
        assert rel_err(got, want) <= tol, f"{what} {k}: {rel_err(got, want):.2e}"


# (leading dims, ngroups, group_size, layout): partial row blocks at every tile class, groups of a power of two
# and not, several groups; groups over 4096 go to the column-tiled kernels (gated_norm_wide: 512-column tiles, one
# specialisation per tile count; the backward's two: 1024-column tiles): a partial last column tile at 5000, two
# groups of 5120 over 6 rows, the last row block partial, and the largest group the kernels take, 8192.
SHAPES = [
    ((3, 50), 2, 64, "slice"),         # GS 64, BR 64: 150 rows, 3 row blocks, the last partial
    ((2, 37), 3, 100, "slice"),        # GS 128 padded, BR 32
    ((5, 7), 1, 1000, "transposed"),   # GS 1024, BR 4
    ((9,), 2, 4096, "contig"),         # GS 4096, BR 1
    ((2, 3), 1, 5000, "slice"),        # wide: 10 column tiles of 512 (5 of 1024 backward), the last partial
    ((6,), 2, 5120, "slice"),          # wide: 2 groups, BR 4 over 6 rows
    ((5,), 1, 8192, "contig"),         # wide: 16 column tiles of 512, BR 4 over 5 rows
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"gs{s[2]}x{s[1]}" for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_match_reference(shape, dtype):
    lead, ngroups, group_size, layout = shape
    # every option at the smaller tiles; two at the large ones (the emulator runs each program's tile in PyTorch)
    names = list(OPTIONS) if group_size < 4096 else ["gate_after_bias", "gate_before"]
    for i, name in enumerate(names):
        # few backward programs (sm_count 2): each walks several row blocks
        _check(lead, ngroups, group_size, dtype, name, layout, i + group_size, sm_count=2)


@st.composite
def cases(draw):
    return dict(lead=tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))),
                ngroups=draw(st.integers(1, 3)), group_size=draw(st.sampled_from([1, 7, 32, 64, 100, 333, 2048])),
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                name=draw(st.sampled_from(sorted(OPTIONS))),
                layout=draw(st.sampled_from(["contig", "slice", "transposed"])),
                seed=draw(st.integers(0, 2 ** 16)), sm_count=draw(st.integers(1, 4)))


@given(cases())
@SWEEP
def test_sweep(kw):
    if kw["layout"] == "transposed" and len(kw["lead"]) < 2:
        kw["layout"] = "contig"
    _check(**kw)


def test_launches_are_compiled_specialisations():
    """Each launch of the two kernels here is a specialisation tests/test_kernels_compile.py builds (also checked,
    for every emulated launch, by tests/test_emulated_plans.py)."""
    from m2ops.kernels.specs import all_specs
    for gs in (300, 5000):  # (5000: the column-tiled forward)
        x, w, b, zt, dy = _inputs((4,), 2, gs, torch.bfloat16, True, True, "slice", 0)
        with emulated_kernels():
            _, r = norm.rms_norm_gated(x, w, b, zt, 1e-5, gs, True)
            norm.rms_norm_gated_bwd(dy, x, w, b, zt, r, 1e-5, gs, True)
    names = ("gated_norm_kernel", "gated_norm_wide_kernel", "gated_norm_bwd_kernel", "gated_norm_wide_rows_kernel",
             "gated_norm_wide_bwd_kernel")
    ours = {k for k in LAUNCHED if k[0] in names}
    assert {k[0] for k in ours} == set(names) and ours <= {s.key() for s in all_specs()}


@pytest.mark.parametrize("group_size", [100, 5000])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_reads_weights_in_the_activations_dtype(group_size, bias):
    """weight and bias in the activations' dtype go to the forward kernels as they are (a decode step launches no
    conversion for them), and give the reference's output."""
    x, w, b, zt, _ = _inputs((3, 5), 2, group_size, torch.bfloat16, True, bias, "slice", 1)
    w, b = w.to(torch.bfloat16), (b.to(torch.bfloat16) if b is not None else None)
    ey, er = ref.rms_norm_gated(x, w, b, zt, 1e-5, group_size, False)
    with emulated_kernels():
        y, r = norm.rms_norm_gated(x, w, b, zt, 1e-5, group_size, False)
    assert rel_err(y, ey) <= TOL[torch.bfloat16] and rel_err(r, er) <= TOL[torch.float32]
    name = "gated_norm_wide_kernel" if group_size > 4096 else "gated_norm_kernel"
    assert any(k[0] == name and ("weight", "bfloat16", 2) in k[2] for k in LAUNCHED)


def test_empty_rows_launch_nothing():
    x = torch.zeros(0, 64)
    with emulated_kernels():
        y, r = norm.rms_norm_gated(x, torch.ones(64), None, x, 1e-5, 32, False)
        dx, dw, db, dz = norm.rms_norm_gated_bwd(x, x, torch.ones(64), torch.ones(64), x, r, 1e-5, 32, False)
    assert y.shape == (0, 64) and r.shape == (2, 0) and dz.shape == (0, 64)
    assert torch.equal(dw, torch.zeros(64)) and torch.equal(db, torch.zeros(64))
