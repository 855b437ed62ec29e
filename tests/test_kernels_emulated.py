"""The cuTile kernels' own code run on the CPU (tests/tile_emulator.py) against the reference, in CI.

The same launchers, grids, index arithmetic, masks, tails and specialisation choices as on a GPU; only the
tile primitives are emulated in PyTorch. What this catches: wrong indices, masks, tails, strides, groups and
launch grids, before a GPU run. What it does not: compiler failures (tests/test_kernels_compile.py), races,
speed. The tolerances are the GPU tests' (tests/gpu/gpu_cases.py TOL): the emulator rounds the tile
products' inputs as the kernels ask (dtype casts, tf32), so it errs the same way.

Skipped when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from gpu_cases import TOL, make_case, per_head_sum_err, per_head_sum_scales, reference_forward, rel_err  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import common, config, decode, forward, planned, runtime, scan, specialise  # noqa: E402
from m2ops.reference import chunked as ref  # noqa: E402
from knobs import knobs  # noqa: E402
from m2ops.meta import shapes  # noqa: E402
from m2ops.reference import state_update as ref_su  # noqa: E402

EXAMPLES = int(os.environ.get("M2OPS_EMULATED_EXAMPLES", "80"))
SWEEP = settings(max_examples=EXAMPLES, deadline=None, derandomize=True)


def _check(out, expected, kind, dtype, what):
    err = rel_err(out, expected)
    assert err <= TOL[kind][dtype], f"{what}: relative error {err:.3e} > {TOL[kind][dtype]:.0e}"


@contextlib.contextmanager
def emulated_launches():
    """emulated_kernels(), recording every launch as (kernel name, grid, arguments)."""
    launches = []
    with emulated_kernels():
        emulated = runtime.launch

        def spy(grid, kernel, args, *rest):
            launches.append((kernel._pyfunc.__name__, grid, args))
            return emulated(grid, kernel, args, *rest)

        runtime.launch = spy  # emulated_kernels puts the real launcher back on exit
        yield launches


@st.composite
def cases(draw, varlen_ok=False):
    """Like the GPU sweep's cases, at sizes the emulator runs in about a second."""
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    nheads = draw(st.sampled_from([1, 2, 4]))
    seqlen = draw(st.one_of(st.integers(1, 40), st.integers(41, 300)))
    varlen = varlen_ok and seqlen >= 2 and draw(st.booleans())
    return dict(
        dtype=dtype, chunk_size=draw(st.sampled_from([16, 32, 64, 128, 256])),
        batch=1 if varlen else draw(st.integers(1, 2)), seqlen=seqlen, nheads=nheads,
        ngroups=draw(st.sampled_from([g for g in (1, 2, 4) if nheads % g == 0])),
        headdim=draw(st.sampled_from([4, 16, 64, 80])),
        dstate=draw(st.sampled_from([8, 16, 64, 100, 128, 256, 512])),
        dt_softplus=draw(st.booleans()), dt_bias=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.002, 0.3)])),
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        initial_states=draw(st.booleans()),
        seq_idx=(not varlen) and draw(st.booleans()), cu_seqlens=varlen, nseqs=draw(st.integers(1, 6)),
        noncontig=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        dt_dtype=draw(st.sampled_from([None, torch.float32])), device="cpu",
    )


@given(cases(varlen_ok=True))
@SWEEP
def test_forward_kernels(kw):
    """chunk_cumsum, fwd_pass_state (with varlen states), compute_out, one at a time on the reference's
    intermediates."""
    case = make_case(**kw)
    varlen = case["cu_seqlens"] is not None
    y_ref, fin_ref, var_ref, mid = reference_forward(case, return_varlen=varlen)
    dtype = case["x"].dtype
    lo, hi = case["dt_limit"]
    with emulated_kernels():
        dt_out, cs = forward.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], case["chunk_size"],
                                         case["dt_softplus"], float(lo), float(hi))
        st_, fin, var = forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                              case["initial_states"], case["seq_idx"],
                                              case["cu_seqlens"] if varlen else None)
        y = forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                               case["D"], case["z"], case["seq_idx"])
    _check(dt_out, mid["dt_out"], "cumsum", dtype, "dt_out")
    _check(cs, mid["dA_cumsum"], "cumsum", dtype, "dA_cumsum")
    _check(st_, mid["states"], "states", dtype, "states")
    _check(fin, fin_ref, "states", dtype, "final_states")
    _check(var, var_ref, "states", dtype, "varlen_states")
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    _check(y, y_ref, "y", dtype, "y")


@st.composite
def carry_cases(draw):
    """cases() where compute_out_carry can run and has state to carry: chunks of several row blocks, sequences
    of more than one row block, dstate up to OUT_CARRY_MAX_DSTATE."""
    kw = draw(cases())
    kw.update(chunk_size=draw(st.sampled_from([128, 256])), seqlen=draw(st.integers(65, 600)),
              dstate=draw(st.sampled_from([8, 16, 64, 100, 128])), headdim=draw(st.sampled_from([4, 16, 64])))
    return kw


@given(carry_cases(), st.booleans(), st.booleans())
@SWEEP
def test_compute_out_carry_and_walk(kw, carry, reverse):
    """compute_out's two output kernels on the reference's intermediates: compute_out_carry (one program per
    chunk, the state carried through its row blocks, chunk_cb's diagonal blocks only) where it can run, and the
    column walk, each forced, each in either order of chunks (the config's out_reverse); seq_idx, D, z, initial states, ragged
    ends and every dtype."""
    case = make_case(**kw)
    y_ref, _, _, mid = reference_forward(case)
    with config.override(out_carry=carry, out_reverse=reverse), emulated_launches() as launches:
        y = forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                                case["D"], case["z"], case["seq_idx"])
    names = [name for name, _, _ in launches]
    if launches:
        want = ("compute_out_carry_kernel" if carry and specialise.out_carry_can_run(case["B"].shape[3], case["chunk_size"])
                else "compute_out_kernel")
        assert names == ["chunk_cb_kernel", want]
        diag = launches[0][2][-1]  # chunk_cb's DIAG: the diagonal blocks alone for the carry
        assert diag == (want == "compute_out_carry_kernel")
    _check(y, y_ref, "y", case["x"].dtype, "y")


def test_out_carry_default_rule(monkeypatch):
    """The carry is the default at dstate <= 64 at any length and at dstate 65-128 from OUT_CARRY_WIDE_SEQLEN
    tokens; never above OUT_CARRY_MAX_DSTATE or for chunks of one row block; the override forces either."""
    wide = specialise.OUT_CARRY_WIDE_SEQLEN
    assert specialise.out_carry_applies(64, 256, 1024) and specialise.out_carry_applies(16, 128, 100)
    assert not specialise.out_carry_applies(128, 256, wide - 1) and specialise.out_carry_applies(128, 256, wide)
    assert not specialise.out_carry_applies(256, 256, 1 << 18) and not specialise.out_carry_applies(64, 64, 1 << 16)
    knobs(monkeypatch, out_carry=False)
    assert not specialise.out_carry_applies(64, 256, 1 << 16)
    knobs(monkeypatch, out_carry=True)
    assert specialise.out_carry_applies(128, 256, 1024) and not specialise.out_carry_applies(256, 256, 1024)


def _bf16_case(**kw):
    """A bfloat16 case on the CPU (make_case's defaults otherwise: softplus, dt_bias, no dt_limit)."""
    return make_case(dtype=torch.bfloat16, device="cpu", **kw)


@pytest.mark.parametrize("chunk_size,seqlen", [(16, 48), (64, 192), (128, 256), (256, 512)])
@pytest.mark.parametrize("seq_idx", [False, True])
def test_in_bounds_kernels_skip_bounds_checks(chunk_size, seqlen, seq_idx):
    """Tile-aligned shapes take chunk_state's and compute_out's unchecked loads (CHK=False; the emulator
    raises if such a load leaves its array)."""
    case = _bf16_case(chunk_size=chunk_size, batch=2, seqlen=seqlen, nheads=4, ngroups=2, headdim=64, dstate=128,
                      D="h", z=True, initial_states=True, seq_idx=seq_idx, nseqs=3, seed=seqlen)
    assert specialise.tiles_in_bounds(seqlen, 64, 128, specialise.chunk_state_constants(chunk_size, seq_idx))
    y_ref, fin_ref, _, mid = reference_forward(case)
    with emulated_kernels():
        st_, fin, _ = forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                            case["initial_states"], case["seq_idx"], None)
        y = forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"],
                               mid["states"], case["D"], case["z"], case["seq_idx"])
    _check(st_, mid["states"], "states", torch.bfloat16, "states")
    _check(fin, fin_ref, "states", torch.bfloat16, "final_states")
    _check(y, y_ref, "y", torch.bfloat16, "y")


def test_unchecked_load_outside_array_raises(monkeypatch):
    """The emulator's guard for CHK=False: a launcher that promised in-bounds tiles for a ragged shape fails."""
    case = _bf16_case(chunk_size=64, seqlen=100, nheads=2, headdim=64, dstate=64, dt_softplus=False,
                      dt_bias=False, nseqs=1, seed=1)
    _, _, _, mid = reference_forward(case)
    monkeypatch.setattr(specialise, "tiles_in_bounds", lambda *a: True)  # a wrong promise
    with emulated_kernels(), pytest.raises(IndexError, match="check_bounds=False"):
        forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                           None, None, None)


@pytest.mark.parametrize("headdim,dstate,block,checked", [(16, 32, 512, False), (16, 64, 512, False),
                                                          (16, 20, 512, True), (80, 100, 1024, True)])
@pytest.mark.parametrize("seq_idx", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_state_passing_checks_only_partial_blocks(monkeypatch, headdim, dstate, block, checked, seq_idx, separate):
    """state_passing loads its blocks unchecked (CHK False) exactly where the block divides a head's state, and
    gives the reference's entering and final states either way (in place, or to the separate bfloat16 array),
    across seq_idx restarts and an odd number of chunks. The emulator raises if an unchecked load leaves its
    array."""
    knobs(monkeypatch, state_block=block)
    case = _bf16_case(chunk_size=64, batch=2, seqlen=300, nheads=2, ngroups=1, headdim=headdim, dstate=dstate,
                      initial_states=True, seq_idx=seq_idx, nseqs=3, seed=dstate)
    _, fin_ref, _, mid = reference_forward(case)
    with emulated_launches() as launches:
        st_, fin, _ = forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                            case["initial_states"], case["seq_idx"], None,
                                            entering_dtype=torch.bfloat16 if separate else None)
    # the constants end the arguments: BLK, HAS_SEQ, LAT, SEP, CHK
    assert [(a[-5], a[-1]) for name, _, a in launches if name == "state_passing_kernel"] == [(block, checked)]
    assert specialise.state_passing_checks(block, headdim * dstate) is checked
    _check(st_.float(), mid["states"], "states", torch.bfloat16, "entering states")
    _check(fin, fin_ref, "states", torch.bfloat16, "final_states")


def test_kept_state_plan_follows_the_forward_block(monkeypatch):
    """The config (its state_block here) is part of a kept plan's key: changing it between two identical calls
    changes the block the second call launches with."""
    case = _bf16_case(chunk_size=64, batch=1, seqlen=200, nheads=2, ngroups=1, headdim=16, dstate=64, seed=3)
    _, _, _, mid = reference_forward(case)
    with emulated_launches() as launches:
        for block in (512, 1024):
            knobs(monkeypatch, state_block=block)
            forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], None, None, None)
    assert [a[-5] for name, _, a in launches if name == "state_passing_kernel"] == [512, 1024]


def test_state_blocks_of_forward_and_backward(monkeypatch):
    """The forward's walk takes FORWARD_STATE_BLOCK whatever the shape; the backward's walk keeps its own rule
    (the largest block that still fills the GPU); STATE_BLOCK_OVERRIDE sets both."""
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert specialise.forward_state_block() == specialise.FORWARD_STATE_BLOCK == 512
    assert specialise.backward_walk_block(1, 80, 64 * 128, cpu) == 1024
    assert specialise.backward_walk_block(1, 80, 64 * 256, cpu) == 2048
    knobs(monkeypatch, state_block=2048)
    assert specialise.forward_state_block() == specialise.backward_walk_block(1, 80, 64 * 128, cpu) == 2048


@given(cases(), st.sampled_from([True, None]))
@SWEEP
def test_chunk_scan(kw, path):
    """The chunk_scan op: the fused segment kernels forced (True) and the launcher's choice (None)."""
    case = make_case(**kw)
    y_ref, fin_ref, _, mid = reference_forward(case)
    dtype = case["x"].dtype
    with config.override(segments=path), emulated_kernels():
        y, fin = scan.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                 case["initial_states"], case["D"], case["z"], case["seq_idx"])
    _check(y, y_ref, "y", dtype, "y")
    _check(fin, fin_ref, "states", dtype, "final_states")


@pytest.mark.parametrize("segments", [1, 3, 1000])
def test_chunk_scan_segment_counts(segments):
    """Any number of segments gives the same result: one walk over everything, uneven segments, one block
    per segment."""
    case = make_case(seqlen=333, nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=64,
                     dtype=torch.float32, initial_states=True, seq_idx=True, D="h", z=True, device="cpu")
    y_ref, fin_ref, _, mid = reference_forward(case)
    with config.override(segments=True, segment_count=segments), emulated_kernels():
        y, fin = scan.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                 case["initial_states"], case["D"], case["z"], case["seq_idx"])
    _check(y, y_ref, "y", torch.float32, "y")
    _check(fin, fin_ref, "states", torch.float32, "final_states")


@pytest.mark.parametrize("seqlen,sub", [(300, 64), (700, 128), (64, 64), (1000, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_scan_on_sub_chunks(seqlen, sub, dtype):
    """chunk_scan's sub-chunk candidate (scan.rechunk, a tuning choice): dt_out and dA_cumsum of chunk 256
    re-cut into chunks of `sub` give the reference's y and final state at chunk 256, with seq_idx restarts,
    initial states, D and z, T not a multiple of either chunk size."""
    case = make_case(seqlen=seqlen, nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=256, dtype=dtype,
                     initial_states=True, seq_idx=True, D="h", z=True, device="cpu", seed=seqlen)
    y_ref, fin_ref, _, mid = reference_forward(case)
    with emulated_kernels():
        blk = specialise.forward_state_block()
        y, fin = scan.chunk_scan_with({"path": "split", "state_block": blk, "chunk": sub}, case["x"],
                                         mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                         case["initial_states"], case["D"], case["z"], case["seq_idx"])
    _check(y, y_ref, "y", dtype, "y")
    _check(fin, fin_ref, "states", dtype, "final_states")


@pytest.mark.parametrize("seqlen,L", [(300, 128), (700, 64), (100, 64), (1000, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_scan_on_super_chunks(seqlen, L, dtype):
    """chunk_scan's super-chunk candidate (a tuning choice for callers' chunks below scan.SUPER_CHUNK):
    dt_out and dA_cumsum of chunk L carried across into chunks of 256 (scan.rechunk) give the reference's y
    and final state at chunk L, with seq_idx restarts, initial states, D and z, T not a multiple of either chunk
    size and a last chunk of 256 that holds fewer L-chunks than it has room for."""
    case = make_case(seqlen=seqlen, nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=L, dtype=dtype,
                     initial_states=True, seq_idx=True, D="h", z=True, device="cpu", seed=seqlen + L)
    y_ref, fin_ref, _, mid = reference_forward(case)
    dt2, cs2 = scan.rechunk(mid["dt_out"], mid["dA_cumsum"], scan.SUPER_CHUNK, seqlen)
    want_dt, want_cs = ref.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], scan.SUPER_CHUNK, True,
                                               *case["dt_limit"])
    assert cs2.shape == want_cs.shape == (1, 2, shapes.num_chunks(seqlen, 256), 256)
    assert torch.equal(dt2, want_dt.float()) and torch.allclose(cs2, want_cs.float(), rtol=1e-5, atol=1e-5)
    with emulated_kernels():
        blk = specialise.forward_state_block()
        y, fin = scan.chunk_scan_with({"path": "split", "state_block": blk, "chunk": scan.SUPER_CHUNK},
                                         case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                         case["initial_states"], case["D"], case["z"], case["seq_idx"])
    _check(y, y_ref, "y", dtype, "y")
    _check(fin, fin_ref, "states", dtype, "final_states")


DECODE_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # as the GPU decode tests


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dstate", [16, 100, 256, 300])
@pytest.mark.parametrize("opts", [dict(), dict(D="hp", z=True, dt_bias=True, softplus=True, limit=(0.01, 0.5)),
                                  dict(D="h", state_dtype="act")])
def test_state_update(dtype, dstate, opts):
    g = torch.Generator().manual_seed(dstate)
    b, h, G, p = 2, 4, 2, 24
    state_dtype = dtype if opts.get("state_dtype") == "act" else torch.float32
    kw = dict(
        state=torch.randn(b, h, p, dstate, generator=g).to(state_dtype),
        x=torch.randn(b, h, p, generator=g).to(dtype),
        dt=torch.rand(b, h, generator=g).to(dtype),
        A=-torch.exp(torch.rand(h, generator=g) * math.log(8.0)),
        B=torch.randn(b, G, dstate, generator=g).to(dtype),
        C=torch.randn(b, G, dstate, generator=g).to(dtype),
        D={None: None, "h": torch.randn(h, generator=g), "hp": torch.randn(h, p, generator=g)}[opts.get("D")],
        z=torch.randn(b, h, p, generator=g).to(dtype) if opts.get("z") else None,
        dt_bias=torch.randn(h, generator=g) if opts.get("dt_bias") else None,
        dt_softplus=bool(opts.get("softplus")),
        dt_min=float(opts.get("limit", (0.0, math.inf))[0]), dt_max=float(opts.get("limit", (0.0, math.inf))[1]),
    )
    ey, enew = ref_su.state_update(**kw)
    with emulated_kernels():
        y, new = decode.state_update(**kw)
    assert y.dtype == ey.dtype and new.dtype == enew.dtype
    assert rel_err(y, ey) <= DECODE_TOL[dtype]
    assert rel_err(new, enew) <= DECODE_TOL[state_dtype]


def test_unpadded_out_of_bounds_loads_are_poisoned():
    """The emulator's own check: a load past the end without zero padding reads NaN, so a kernel that
    depends on one cannot pass by luck."""
    from tile_emulator import _Emu
    emu = _Emu()
    a = torch.arange(10, dtype=torch.float32)
    t = emu.load(a, (2,), shape=(4,))
    assert torch.equal(t[:2], a[8:]) and torch.isnan(t[2:]).all()
    import cuda.tile as ct
    z = emu.load(a, (2,), shape=(4,), padding_mode=ct.PaddingMode.ZERO)
    assert torch.equal(z, torch.tensor([8.0, 9.0, 0.0, 0.0]))


# ---- backward kernels (m2ops/kernels/backward.py) ----

# Gradients: products with the float32 cotangents run in tf32 (u = 2^-11), for bfloat16 inputs in bfloat16 with
# the weighted operands rounded (u = 2^-8, backward.py's LOWP), and g_x / g_B / g_dt are rounded to their inputs'
# dtypes (2^-11 float16, 2^-8 bfloat16): normwise errors average below those.
BWD_TOL = {torch.float32: 3e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
CUMSUM_BWD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _cotangent(t, gen):
    return torch.randn(t.shape, generator=gen, dtype=torch.float32)


@given(cases())
@SWEEP
def test_backward_kernels(kw):
    """chunk_cumsum_bwd and fwd_pass_state_bwd against the reference backward formulas."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(**kw)
    _, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])
    lo, hi = case["dt_limit"]
    args = (_cotangent(mid["dt_out"], gen), _cotangent(mid["dA_cumsum"], gen), case["dt"], case["A"],
            case["dt_bias"], case["chunk_size"], case["dt_softplus"], float(lo), float(hi))
    want = ref_bwd.chunk_cumsum_bwd(*args)
    with emulated_kernels():
        got = backward.chunk_cumsum_bwd(*args)
    _assert_no_aliasing(args, got)
    # g_A and g_dt_bias are one float32 sum per head over every token, whose random-signed terms cancel: 1e-4.
    for name, a, b, tol in zip(("g_dt", "g_A", "g_dt_bias"), got, want,
                               (CUMSUM_BWD_TOL[case["dt"].dtype], 1e-4, 1e-4)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"

    args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
            case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"], None)
    want = ref_bwd.fwd_pass_state_bwd(*args)
    with emulated_kernels():
        got = backward.fwd_pass_state_bwd(*args)
        # given the entering states and another op's g_x to add (as chunk_scan's backward passes them)
        base = _cotangent(case["x"], gen).to(case["x"].dtype)
        got_given = backward.fwd_pass_state_bwd(*args, mid["states"], base)
    _assert_no_aliasing(args, got)
    _assert_no_aliasing((*args, base), got_given)
    dtype = case["x"].dtype
    want_given = (ref_bwd.fwd_pass_state_bwd(*args, None, base)[0], *want[1:])
    assert rel_err(want_given[0].float(), want[0].float() + base.float()) <= BWD_TOL[dtype]
    for name, a, b, c, d in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum", "g_init"), got, want, got_given,
                                want_given):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert c.shape == d.shape and c.dtype == d.dtype and c.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"{name}: {rel_err(a, b):.3e}"
        assert rel_err(c, d) <= BWD_TOL[dtype], f"{name} (states and g_x_base given): {rel_err(c, d):.3e}"


def _assert_no_aliasing(args, outputs):
    """The launchers are the CUDA implementations of custom ops, whose outputs may alias neither an input nor
    each other (torch raises at dispatch otherwise, which the CPU reference path never shows)."""
    assert not torch._C._any_output_is_alias_to_input_or_output(args, {}, tuple(outputs))


def test_backward_kernels_with_mixed_input_dtypes():
    """x in float16 with B and C in bfloat16 (the kernels compute in their promotion, float32): every gradient
    of fwd_pass_state_bwd and compute_out_bwd comes back in the dtype the reference gives, within tolerance."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(seqlen=200, nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, dtype=torch.float16,
                     initial_states=True, D="h", z=True, device="cpu", seed=5)
    case["B"], case["C"] = case["B"].to(torch.bfloat16), case["C"].to(torch.bfloat16)
    y_ref, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(5)
    state_args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
                  case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], None, None)
    out_args = (torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype), case["x"], mid["dt_out"], mid["dA_cumsum"],
                case["C"], case["B"], mid["states"], case["D"], case["z"], None)
    for fn, args in (("fwd_pass_state_bwd", state_args), ("compute_out_bwd", out_args)):
        want = getattr(ref_bwd, fn)(*args)
        with emulated_kernels():
            got = getattr(backward, fn)(*args)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype, (fn, i, a.dtype, b.dtype)
            assert rel_err(a, b) <= BWD_TOL[torch.float16], f"{fn} output {i}: {rel_err(a, b):.3e}"


EAGER_LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("opts", [
    dict(dtype=torch.bfloat16, D="hp", z=True, initial_states=True, seqlen=150),
    dict(dtype=torch.bfloat16, seq_idx=True, nseqs=3, seqlen=200, batch=2),
    dict(dtype=torch.float16, D="h", seq_idx=True, nseqs=3, dt_limit=(0.002, 0.3), dt_softplus=False, seqlen=97),
    dict(dtype=torch.float32, batch=2, dt_bias=False, z=True, seqlen=64),
])
def test_eager_path_matches_reference(opts, split, monkeypatch):
    """The public function's direct path (m2ops/ops/eager.py: the launchers from one autograd.Function, no
    custom-op layers) on the emulator: y, the final states and every input's gradient against the reference's
    autograd in float32, through the fused scan and through the two-op path (whose bfloat16 entering states
    the backward reuses for bfloat16 inputs instead of recomputing them). Tolerances: the forward's, and twice
    the backward kernels' (A's and dt_bias's relative to their per-token terms, as
    tests/gpu/test_backward_kernels.py)."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import eager
    knobs(monkeypatch, segments=not split)
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=11, **opts)
    gen = torch.Generator().manual_seed(11)
    recomputes = []
    real_fps = forward.fwd_pass_state

    def counted(*a, **k):
        recomputes.append(1)
        return real_fps(*a, **k)
    from m2ops import kernels
    monkeypatch.setattr(scan, "fwd_pass_state", counted)  # the forward's two-op path
    monkeypatch.setattr(kernels, "fwd_pass_state", counted)  # the eager backward's recompute

    def direct(a):
        with emulated_kernels():
            return eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], case["chunk_size"], a["D"], a["z"],
                                       a["dt_bias"], a["initial_states"], case["seq_idx"], case["dt_softplus"],
                                       *map(float, case["dt_limit"]))

    leaves = {k: case[k].detach().requires_grad_() for k in EAGER_LEAVES if case[k] is not None}
    args = {**case, **leaves}
    y, fin = direct(args)
    with emulated_kernels():
        g_y, g_fin = torch.randn(y.shape, generator=gen).to(y.dtype), torch.randn(fin.shape, generator=gen)
        forward_calls = len(recomputes)
        torch.autograd.backward((y, fin), (g_y, g_fin))
    # the backward recomputes the entering states unless the forward kept its bfloat16 copy
    assert forward_calls == int(split)
    kept = split and case["x"].dtype == torch.bfloat16
    assert len(recomputes) - forward_calls == (0 if kept else 1)
    if kept:
        # Against the recompute: out_bwd_dcdb rounds float32 states to bfloat16 itself, so every gradient but
        # those through the chunk-end carries (dt, A, dt_bias: <g_S, S> with S rounded) is the same bits.
        monkeypatch.setattr(eager, "KEEP_STATES", False)
        again = {k: case[k].detach().requires_grad_() for k in leaves}
        y2, fin2 = direct({**case, **again})
        with emulated_kernels():
            torch.autograd.backward((y2, fin2), (g_y, g_fin))
        assert torch.equal(y, y2) and torch.equal(fin, fin2)
        for name in leaves:
            if name in ("dt", "A", "dt_bias"):
                assert rel_err(leaves[name].grad, again[name].grad) <= 2e-3, name
            else:
                assert torch.equal(leaves[name].grad, again[name].grad), name
    with torch.no_grad():  # no gradient wanted: nothing kept, y the same
        y3, fin3 = direct(args)
    assert torch.equal(y3, y) and torch.equal(fin3, fin)

    cpu = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in case.items()}

    def run(c):
        lv = {k: c[k].detach().requires_grad_() for k in EAGER_LEAVES if c[k] is not None}
        yr, finr = mamba_chunk_scan_combined(**{**c, **lv}, return_final_states=True)
        return yr, finr, lv

    y_r, fin_r, leaves_r = run(cpu)
    cot = (g_y.float(), g_fin)
    torch.autograd.backward((y_r, fin_r), cot)
    dtype = case["x"].dtype
    assert y.dtype == dtype and fin.dtype == torch.float32
    assert rel_err(y, y_r) <= TOL["y"][dtype] and rel_err(fin, fin_r) <= TOL["states"][dtype]
    scales = per_head_sum_scales(run, cpu, cot, leaves_r)
    for name, leaf in leaves.items():
        got, want = leaf.grad, leaves_r[name].grad
        assert got is not None and got.dtype == leaf.dtype and got.shape == leaf.shape, name
        err = rel_err(got, want)
        if name in scales:
            err = per_head_sum_err(got, want, scales[name])
        assert err <= 2 * BWD_TOL[dtype], f"grad of {name}: {err:.3e}"


def test_eager_training_on_super_chunks(monkeypatch):
    """A training call whose chunk_scan configuration runs on chunks of 256 for the caller's 64 (the tuning
    candidate scan.SUPER_CHUNK): y and the final state within rounding of the caller's chunking, and the
    backward, which cannot reuse states kept at another chunk size, recomputes them at the caller's: every
    gradient is bit for bit that of the default configuration without kept states."""
    from m2ops.ops import eager
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=5,
                     dtype=torch.bfloat16, D="h", z=True, initial_states=True, seqlen=300)
    gen = torch.Generator().manual_seed(5)
    blk = specialise.forward_state_block()
    real_configs = scan.kept_scan_configs
    cot = (torch.randn(case["x"].shape, generator=gen).to(torch.bfloat16),
           torch.randn(case["initial_states"].shape, generator=gen))

    def run(config, keep):
        monkeypatch.setattr(eager, "KEEP_STATES", keep)
        monkeypatch.setattr(scan, "kept_scan_configs",
                            (lambda *a: (config, [])) if config else real_configs)
        leaves = {k: case[k].detach().requires_grad_() for k in EAGER_LEAVES if case[k] is not None}
        a = {**case, **leaves}
        with emulated_kernels():
            y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, a["D"], a["z"], a["dt_bias"],
                                         a["initial_states"], None, True, 0.0, float("inf"))
            torch.autograd.backward((y, fin), cot)
        return y, fin, leaves

    chunks = []
    real_rechunk = scan.rechunk
    monkeypatch.setattr(scan, "rechunk", lambda dt, cs, chunk, T: chunks.append(chunk) or real_rechunk(dt, cs,
                                                                                                       chunk, T))
    y, fin, leaves = run({"path": "split", "state_block": blk, "chunk": scan.SUPER_CHUNK}, True)
    assert chunks == [scan.SUPER_CHUNK]
    y0, fin0, leaves0 = run(None, False)
    assert chunks == [scan.SUPER_CHUNK]
    assert rel_err(y, y0) <= 2e-2 and rel_err(fin, fin0) <= 2e-2  # another chunking: rounding apart
    for name in leaves:
        assert torch.equal(leaves[name].grad, leaves0[name].grad), name


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_public_call_runs_long_sequences_on_super_chunks(monkeypatch, train):
    """The public function, where the kernels serve it, runs a caller's chunk of 64 on long sequences at
    scan.SUPER_CHUNK from chunk_cumsum on (ops.dispatch.kernel_chunk_size): the same bits, y, final state and
    every gradient, as the eager path called at that chunk size, and nothing re-cut (scan.rechunk unused);
    within rounding of the reference at the caller's chunk. The threshold is lowered to this test's 300
    tokens; the CUDA path runs on CPU tensors through the emulator."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import dispatch, eager
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=7,
                     dtype=torch.bfloat16, D="h", z=True, initial_states=True, seqlen=300)
    knobs(monkeypatch, super_chunk_min_seqlen=300)
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: True)
    monkeypatch.setattr(eager, "applies",  # the CUDA path on CPU tensors
                        lambda run_chunk, deciding, others: eager.context_allows(deciding + others))
    monkeypatch.setattr(scan, "rechunk", lambda *a: pytest.fail("rechunk ran"))
    assert dispatch.kernel_chunk_size(64, 300, case["x"].device) == scan.SUPER_CHUNK
    gen = torch.Generator().manual_seed(7)
    cot = (torch.randn(case["x"].shape, generator=gen).to(torch.bfloat16),
           torch.randn(case["initial_states"].shape, generator=gen))

    def run(public):
        leaves = {k: case[k].detach().requires_grad_(train) for k in EAGER_LEAVES if case[k] is not None}
        a = {**case, **leaves}
        with emulated_kernels():
            if public:
                y, fin = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, D=a["D"], z=a["z"],
                                                   dt_bias=a["dt_bias"], initial_states=a["initial_states"],
                                                   dt_softplus=True, return_final_states=True)
            else:
                y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], scan.SUPER_CHUNK, a["D"],
                                             a["z"], a["dt_bias"], a["initial_states"], None, True, 0.0,
                                             float("inf"))
            if train:
                torch.autograd.backward((y, fin), cot)
        return y, fin, leaves

    chunks = []
    real_scan = eager.scan_combined
    monkeypatch.setattr(eager, "scan_combined", lambda *a: chunks.append(a[5]) or real_scan(*a))
    y, fin, leaves = run(True)
    assert chunks == [scan.SUPER_CHUNK]  # the eager path, given the chunk size it runs at
    y1, fin1, leaves1 = run(False)
    assert torch.equal(y, y1) and torch.equal(fin, fin1)
    for name in leaves:
        assert (leaves[name].grad is None) == (not train), name
        if train:
            assert torch.equal(leaves[name].grad, leaves1[name].grad), name
    y_r, fin_r, _, _ = reference_forward(case)
    assert rel_err(y, y_r) <= TOL["y"][torch.bfloat16] and rel_err(fin, fin_r) <= TOL["states"][torch.bfloat16]


def test_eager_path_names_its_steps_in_the_profiler():
    """Under the profiler the direct path runs each launcher inside a record_function of its op's name, so a
    trace shows the same m2ops:: steps as through the custom ops (forward and backward)."""
    from m2ops.ops import eager
    case = make_case(nheads=2, headdim=16, dstate=16, chunk_size=64, seqlen=80, device="cpu", seed=1)
    leaves = {k: case[k].detach().requires_grad_() for k in ("x", "dt", "A", "B", "C")}
    a = {**case, **leaves}
    with torch.profiler.profile() as prof, emulated_kernels():
        y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, None, a["dt_bias"], None,
                                     None, case["dt_softplus"], *map(float, case["dt_limit"]))
        (y.float().sum() + fin.sum()).backward()
    names = {e.name for e in prof.events() if e.name.startswith("m2ops::")}
    assert {"m2ops::chunk_cumsum", "m2ops::chunk_scan", "m2ops::compute_out_bwd", "m2ops::fwd_pass_state_bwd",
            "m2ops::chunk_cumsum_bwd"} <= names, names


def test_eager_path_yields_to_compile_modes_and_subclasses():
    """The direct path serves plain eager calls only: under a dispatch or function mode, a functorch
    transform, or for a tensor subclass, the custom ops must run (they are what those see)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from m2ops.ops import eager
    x = torch.randn(2, 3)
    assert eager.context_allows((x, None, torch.nn.Parameter(torch.randn(3))))
    assert not eager.applies(64, (x,), ())  # a CPU tensor: the ops (reference) serve it

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    with Passthrough():
        assert not eager.context_allows((x,))
    with TorchFunctionMode():
        assert not eager.context_allows((x,))
    with torch.autograd.profiler.profile():  # the direct path names its steps itself (next test)
        assert eager.context_allows((x,))
    assert not eager.context_allows((x, x.as_subclass(Sub)))
    seen = []
    torch.func.vmap(lambda t: seen.append(eager.context_allows((t,))) or t)(x)
    assert seen == [False]


@given(cases())
@SWEEP
def test_compute_out_backward_kernels(kw):
    """compute_out_bwd (every gradient, D and z included) against the reference backward formulas."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(**kw)
    y_ref, _, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])
    g_y = torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype).to(y_ref.device)
    args = (g_y, case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"], case["D"],
            case["z"], case["seq_idx"])
    want = ref_bwd.compute_out_bwd(*args)
    with emulated_kernels():
        got = backward.compute_out_bwd(*args)
    _assert_no_aliasing(args, got)
    dtype = case["x"].dtype
    for name, a, b in zip(("g_x", "g_dt_out", "g_dA_cumsum", "g_C", "g_B", "g_states", "g_D", "g_z"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"{name}: {rel_err(a, b):.3e}"


def test_chunk_scan_tuning_chooses_stores_and_reuses(monkeypatch, tmp_path):
    """The tuner inside the chunk_scan launcher: each candidate is timed (a fake timer here, that prefers the
    fused path at 8 programs per SM), the winner runs and is stored, and a later call reads it back without
    timing anything. Results equal the reference whichever configuration runs."""
    from m2ops.kernels import autotune
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("M2OPS_AUTOTUNE", "1")
    autotune.forget()
    timed = []
    real_with = scan.chunk_scan_with

    def recording_with(cfg, *a):
        timed.append(cfg)
        return real_with(cfg, *a)

    def fake_ms(fn):
        fn()
        return 1.0 if timed[-1] == {"path": "fused", "ppsm": 8} else 2.0

    monkeypatch.setattr(scan, "chunk_scan_with", recording_with)
    monkeypatch.setattr(scan, "tuned", lambda x: True)
    monkeypatch.setattr(scan, "can_search", lambda: True)
    monkeypatch.setattr(scan, "median_ms", fake_ms)
    monkeypatch.setattr(autotune, "environment_key", lambda device_index=0: "test-gpu")
    case = make_case(seqlen=300, nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=64, dtype=torch.float32,
                     initial_states=True, D="h", device="cpu")
    y_ref, fin_ref, _, mid = reference_forward(case)
    args = (case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"], case["initial_states"], case["D"],
            case["z"], case["seq_idx"])
    with emulated_kernels():
        y, fin = scan.chunk_scan(*args)
    _check(y, y_ref, "y", torch.float32, "y")
    _check(fin, fin_ref, "states", torch.float32, "final_states")
    stored = json.loads((tmp_path / "tuning.json").read_text())
    (entry,) = stored.values()
    # searched: the state_passing blocks, the fused path's four segment counts and chunks of 256
    n_blocks = len(common.STATE_BLOCKS)
    assert entry["config"] == {"path": "fused", "ppsm": 8} and entry["searched"] == n_blocks + 4 + 1
    autotune.forget()
    timed.clear()
    with emulated_kernels():
        y2, _ = scan.chunk_scan(*args)
    assert timed == [{"path": "fused", "ppsm": 8}]  # read back from the file: only the call itself ran
    _check(y2, y_ref, "y", torch.float32, "y")
    # Where no search may run (CUDA-graph capture, compile, sync debug mode) the stored choice still applies.
    autotune.forget()
    timed.clear()
    monkeypatch.setattr(scan, "can_search", lambda: False)
    with emulated_kernels():
        scan.chunk_scan(*args)
    assert timed == [{"path": "fused", "ppsm": 8}]
    autotune.forget()


@pytest.mark.parametrize("seq_idx", [False, True])
def test_compute_out_with_cb_in_bf16(monkeypatch, seq_idx):
    """C . B^T stored in bfloat16 for bfloat16 activations: y stays within the bfloat16 tolerance."""
    case = _bf16_case(chunk_size=128, batch=2, seqlen=300, nheads=4, ngroups=2, headdim=16, dstate=64, D="h",
                      z=True, initial_states=True, seq_idx=seq_idx, nseqs=3, seed=7)
    y_ref, _, _, mid = reference_forward(case)
    with emulated_kernels():
        y = forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                               case["D"], case["z"], case["seq_idx"])
    _check(y, y_ref, "y", torch.bfloat16, "y")


@pytest.mark.parametrize("heads,ngroups,hb,seq_idx", [(4, 2, 2, True), (8, 1, 4, False), (6, 2, 2, False),
                                                     (6, 3, 4, False)])
def test_chunk_state_heads_per_program(monkeypatch, heads, ngroups, hb, seq_idx):
    """chunk_state with HB heads per program (config's chunk_state_heads; the table takes 2 for bfloat16 at
    chunk 256): the local states and the final state as with one head per program; where HB does not divide a
    group's heads (6 heads in 3 groups, HB 4) the launcher falls back to one."""
    case = _bf16_case(chunk_size=64, batch=2, seqlen=150, nheads=heads, ngroups=ngroups, headdim=16, dstate=32,
                      initial_states=True, seq_idx=seq_idx, nseqs=2, seed=heads + hb)
    _, fin_ref, _, mid = reference_forward(case)
    knobs(monkeypatch, chunk_state_heads=hb)
    with emulated_kernels():
        st_, fin, _ = forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                            case["initial_states"], case["seq_idx"], None)
    _check(st_, mid["states"], "states", torch.bfloat16, "states")
    _check(fin, fin_ref, "states", torch.bfloat16, "final_states")


@pytest.mark.parametrize("seq_idx", [False, True])
def test_local_states_in_bf16(monkeypatch, seq_idx):
    """At chunk 256 with bfloat16 activations chunk_state stores the local states in bfloat16 and state_passing
    widens them; the final state and y stay within the bf16 tolerances."""
    knobs(monkeypatch, segments=False)
    case = _bf16_case(chunk_size=256, batch=1, seqlen=600, nheads=2, ngroups=1, headdim=16, dstate=32, D="h",
                      initial_states=True, seq_idx=seq_idx, nseqs=2, seed=5)
    y_ref, fin_ref, _, mid = reference_forward(case)
    with emulated_launches() as launches:
        y, fin = scan.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                   case["initial_states"], case["D"], None, case["seq_idx"])[:2]
    assert [a[5].dtype for name, _, a in launches if name == "chunk_state_kernel"] == [torch.bfloat16]
    _check(fin, fin_ref, "states", torch.bfloat16, "final_states")
    _check(y, y_ref, "y", torch.bfloat16, "y")


@pytest.mark.parametrize("seq_idx", [False, True])
def test_chunk_scan_with_entering_states_in_bf16(monkeypatch, seq_idx):
    """For bfloat16 activations state_passing writes the entering states to a separate bfloat16 array (SEP),
    compute_out's bf16 state product reads them; y within the bf16 tolerance, the final state (kept float32)
    within the states'."""
    knobs(monkeypatch, segments=False)
    case = _bf16_case(chunk_size=64, batch=2, seqlen=200, nheads=4, ngroups=2, headdim=16, dstate=32, D="h",
                      z=True, initial_states=True, seq_idx=seq_idx, nseqs=3, seed=11)
    y_ref, fin_ref, _, mid = reference_forward(case)
    with emulated_kernels():
        st_, _, _ = forward.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                          case["initial_states"], case["seq_idx"], None,
                                          entering_dtype=torch.bfloat16)
        y, fin = scan.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                   case["initial_states"], case["D"], case["z"], case["seq_idx"])
    assert st_.dtype == torch.bfloat16
    _check(st_.float(), mid["states"], "states", torch.bfloat16, "entering states (bf16)")
    _check(y, y_ref, "y", torch.bfloat16, "y")
    _check(fin, fin_ref, "states", torch.bfloat16, "final_states")


@pytest.mark.parametrize("dtype,seq_idx,given_states,carry_block,dstate", [
    (torch.bfloat16, True, True, 512, 64), (torch.float32, False, False, None, 32),
    (torch.bfloat16, False, False, 1024, 32), (torch.bfloat16, True, True, None, 20)])
def test_state_carry_grad_apart_from_the_walk(monkeypatch, dtype, seq_idx, given_states, carry_block, dstate):
    """separate_carry_grad forced on (the config): state_passing_bwd walks without gcarry and state_carry_grad
    forms it afterwards; every gradient of fwd_pass_state_bwd matches the reference's as with gcarry in the
    walk, also from the forward's bfloat16 entering states (the eager path's). state_carry_grad's loop takes 2
    full blocks (dstate 64: 1024 elements in blocks of 512), one (carry_block's choice) or one half past its end
    (512 elements in a block of 1024), and the walk's block divides the state (unchecked loads); at dstate 20 (320
    elements) the walk's one block is partial (checked loads)."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(dtype=dtype, device="cpu", chunk_size=64, seqlen=300, nheads=4, ngroups=2, headdim=16,
                     dstate=dstate, initial_states=True, seq_idx=seq_idx, nseqs=3, seed=21)
    case["A"] = case["A"] * 0.02  # slow decay: carries near 1, so that gcarry's share of g_dA_cumsum counts
    _, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(21)
    args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
            case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"], None)
    want = ref_bwd.fwd_pass_state_bwd(*args)
    states = mid["states"].to(torch.bfloat16) if given_states else None
    knobs(monkeypatch, separate_carry_grad=True)
    if carry_block is not None:  # else backward.carry_block's choice
        monkeypatch.setattr(backward, "carry_block", lambda state_elems: carry_block)
    with emulated_launches() as launches:
        got = backward.fwd_pass_state_bwd(*args, states)
    assert "state_carry_grad_kernel" in [name for name, _, _ in launches]
    # the walk's constants end its arguments: BLK, HAS_SEQ, GC, CHK (unchecked where the block divides the state)
    (walk_args,) = [a for name, _, a in launches if name == "state_passing_bwd_kernel"]
    assert walk_args[-2:] == (False, dstate == 20)
    tol = BWD_TOL[dtype] * (2 if given_states else 1)  # bfloat16 entering states: one more rounding
    for name, a, b in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum", "g_init"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"


def test_separate_carry_grad_rule(monkeypatch):
    """gcarry leaves the walk for walk blocks up to SEPARATE_CARRY_MAX_BLOCK unless SEPARATE_CARRY_GRAD forces
    a way."""
    from m2ops.kernels import backward
    knobs(monkeypatch, separate_carry_grad=None)
    top = backward.SEPARATE_CARRY_MAX_BLOCK
    assert backward.separate_carry_grad(top) and not backward.separate_carry_grad(2 * top)
    assert [backward.carry_block(n) for n in (100, 512, 4096, 8192, 64 * 96)] == [512, 512, 4096, 4096, 4096]
    for forced in (True, False):
        knobs(monkeypatch, separate_carry_grad=forced)
        assert backward.separate_carry_grad(top) is forced and backward.separate_carry_grad(2 * top) is forced


def _fused_planned_calls(kw, carry, hb):
    """(launch names, [(y, final)] of two planned calls with FUSED_CUMSUM at any length, (y, final) of the
    launchers) for a cases() draw without seq_idx, the output kernel forced (carry) and chunk_state at hb heads a
    program (two heads are built for bfloat16 at chunk 256 only, so hb 2 takes those)."""
    kw.update(seq_idx=False, cu_seqlens=False, noncontig=False)
    if carry:
        kw.update(chunk_size=max(kw["chunk_size"], 128), dstate=min(kw["dstate"], 128))
    if hb == 2:
        kw.update(dtype=torch.bfloat16, chunk_size=256)
    with pytest.MonkeyPatch.context() as mp:
        knobs(mp, segments=False)
        knobs(mp, out_carry=carry)
        knobs(mp, chunk_state_heads=hb)
        # the launchers' path first, then the fused launch at any length (by default only for short sequences)
        knobs(mp, fused_cumsum=False)
        knobs(mp, fused_cumsum_max_chunks=1 << 30)
        case = make_case(**kw)
        a = _forward_args(case)
        with emulated_launches() as launches:
            want = _launchers_forward(case)
            knobs(mp, fused_cumsum=True)
            n0 = len(launches)
            # twice: the second call on the kept scratch, which the fused launch must write again
            got = [planned.planned_forward(*a), planned.planned_forward(*a)]
    return [name for name, _, _ in launches[n0:]], got, want


@given(kw=cases(), carry=st.booleans(), hb=st.sampled_from([1, 2]))
@settings(max_examples=max(EXAMPLES // 4, 5), deadline=None, derandomize=True)
def test_planned_forward_with_fused_cumsum(kw, carry, hb):
    """FUSED_CUMSUM: the planned forward's chunk_state launch also does chunk_cumsum's work
    (chunk_state_cumsum_cb_kernel) and chunk_cb's, and neither of those is launched; the same bits as the
    launchers, for dt in float32 or the activations' dtype, either output kernel, one or two heads a program."""
    kw.update(chunk_size=256)
    names, got, (y0, fin0) = _fused_planned_calls(kw, carry, hb)
    assert names.count("chunk_state_cumsum_cb_kernel") == 2, names
    assert not {"chunk_cumsum_kernel", "chunk_cb_kernel", "chunk_state_kernel"} & set(names)
    for y, fin in got:
        assert torch.equal(y, y0) and torch.equal(fin, fin0)


def test_fused_cumsum_by_default_for_short_sequences_where_built(monkeypatch):
    """By default (FUSED_CUMSUM, up to FUSED_CUMSUM_MAX_CHUNKS chunks) the planned forward does chunk_cumsum's and
    chunk_cb's work in chunk_state's launch; past that many chunks, at a chunk size it is not built for or with dt
    in a third dtype, chunk_cumsum and chunk_cb keep their launches. The launchers' bits everywhere."""
    knobs(monkeypatch, segments=False)
    most = config.current().fused_cumsum_max_chunks * 256
    # dt_dtype None: dt in the activations' dtype (bfloat16)
    for seqlen, chunk, dt_dtype, fused in ((most, 256, None, True), (300, 256, torch.float32, True),
                                           (most + 1, 256, None, False), (300, 64, None, False),
                                           (300, 256, torch.float16, False)):
        case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, seqlen=seqlen, chunk_size=chunk, device="cpu",
                         seed=4, dtype=torch.bfloat16, dt_dtype=dt_dtype)
        with emulated_launches() as launches:
            y0, fin0 = _launchers_forward(case)
            n0 = len(launches)
            y1, fin1 = planned.planned_forward(*_forward_args(case))
        names = [name for name, _, _ in launches[n0:]]
        if fused:
            assert "chunk_state_cumsum_cb_kernel" in names, names
            assert not {"chunk_cumsum_kernel", "chunk_cb_kernel", "chunk_state_kernel"} & set(names), names
        else:
            assert {"chunk_cumsum_kernel", "chunk_cb_kernel", "chunk_state_kernel"} <= set(names), names
            assert "chunk_state_cumsum_cb_kernel" not in names, names
        assert torch.equal(y1, y0) and torch.equal(fin1, fin0)
    runtime.clear_plans()



def test_every_launch_above_is_a_compiled_specialisation():
    """Every launch the tests above ran (kernel, compiler options, array dtypes and ranks, constants; launches
    under a profiling override excluded) is one of m2ops.kernels.specs.all_specs(), the list the compile test
    builds for every architecture: a launcher cannot use a dtype or constant combination CI never compiled.
    Runs last in this module, over what the module's earlier tests launched."""
    from tile_emulator import LAUNCHED

    from m2ops.kernels import specs
    if not LAUNCHED:
        pytest.skip("no emulated launches recorded in this process (run the whole module)")
    known = {s.key() for s in specs.all_specs() if not s.narrow}
    unknown = sorted(LAUNCHED - known, key=str)
    assert not unknown, f"{len(unknown)} launched specialisations are not in all_specs(), e.g. {unknown[:2]}"



def _forward_args(case):
    return (case["x"], case["dt"], case["A"], case["B"], case["C"], case["chunk_size"], case["D"], case["z"],
            case["dt_bias"], case["initial_states"], case["dt_softplus"], *map(float, case["dt_limit"]))


def _launchers_forward(case):
    """chunk_cumsum then chunk_scan, launcher by launcher (the path a ForwardPlan stands in for)."""
    x, dt, A, B, C, L, D, z, bias, init, softplus, dt_min, dt_max = _forward_args(case)
    dt_out, cs = forward.chunk_cumsum(dt, A, bias, L, softplus, dt_min, dt_max)
    return scan.chunk_scan(x, dt_out, cs, B, C, init, D, z, None)


def _launchers_forward_at(case, chunk):
    """chunk_cumsum and chunk_scan's two-op path (state block 512) called at `chunk`: what a ForwardPlan made for a
    configuration at that chunk size runs."""
    x, dt, A, B, C, _, D, z, bias, init, softplus, dt_min, dt_max = _forward_args(case)
    dt_out, cs = forward.chunk_cumsum(dt, A, bias, chunk, softplus, dt_min, dt_max)
    return scan.chunk_scan_with({"path": "split", "state_block": 512}, x, dt_out, cs, B, C, init, D, z, None)


@pytest.mark.parametrize("opts", [
    dict(dtype=torch.bfloat16, D="h", z=True, initial_states=True, seqlen=300, chunk_size=256),
    dict(dtype=torch.bfloat16, D="hp", seqlen=130, chunk_size=64),
    dict(dtype=torch.float16, dt_bias=False, dt_limit=(0.002, 0.3), dt_softplus=False, seqlen=97, chunk_size=32),
    dict(dtype=torch.float32, z=True, initial_states=True, seqlen=64, chunk_size=64, batch=2),
])
def test_planned_forward_gives_the_launchers_bits(monkeypatch, opts):
    """planned.planned_forward (the eager forward without gradients, planned once per signature) runs the same
    kernels on the same buffers as chunk_cumsum then chunk_scan: the same bits. The plan is made on the first call
    and reused on the second, and the public path's no-grad branch (eager.scan_combined) takes it."""
    from m2ops.ops import eager
    knobs(monkeypatch, segments=False)
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, device="cpu", seed=5, **opts)
    built, ran = [], []
    real_plan, real_run = planned.forward_plan, planned.run_forward
    monkeypatch.setattr(planned, "forward_plan", lambda *a: built.append(1) or real_plan(*a))
    monkeypatch.setattr(planned, "run_forward", lambda *a: ran.append(1) or real_run(*a))
    a = _forward_args(case)
    with emulated_kernels():
        y0, fin0 = _launchers_forward(case)
        y1, fin1 = planned.planned_forward(*a)
        y2, fin2 = planned.planned_forward(*a)
        with torch.no_grad():
            x, dt, A, B, C, L, D, z, bias, init, softplus, dt_min, dt_max = a
            y3, fin3 = eager.scan_combined(x, dt, A, B, C, L, D, z, bias, init, None, softplus, dt_min, dt_max)
    assert built == [1] and ran == [1, 1, 1]
    for y, fin in ((y1, fin1), (y2, fin2), (y3, fin3)):
        assert y.dtype == case["x"].dtype and torch.equal(y, y0) and torch.equal(fin, fin0)


class _Sub(torch.Tensor):
    """A tensor subclass: the public call leaves it to the ops."""


def _call_key_args(case, **changes):
    """The public call's arguments of a make_case case, in call_key's order, with changes."""
    kw = dict(x=case["x"], dt=case["dt"], A=case["A"], B=case["B"], C=case["C"], chunk_size=case["chunk_size"],
              D=case["D"], z=case["z"], dt_bias=case["dt_bias"], initial_states=case["initial_states"], seq_idx=None,
              cu_seqlens=None, dt_softplus=case["dt_softplus"], dt_limit=tuple(case["dt_limit"]),
              return_final_states=True, return_varlen_states=False)
    kw.update(changes)
    return kw


def test_remembered_call_runs_the_kept_plan(monkeypatch):
    """A plan planned_forward ran for a public call is kept under the call's key (eager.call_key), and
    eager.remembered_call runs it for the next call with that key: the launchers' bits. It declines (None) where
    something besides the arguments is not as it was: gradients wanted, the profiler, a function mode, a changed
    tuning-cache entry (a changed knob is part of the key). call_key is None for the calls that are never kept and while
    nothing is kept; it differs where an argument's type, size, dtype or layout differs."""
    from m2ops.ops import eager
    knobs(monkeypatch, segments=False)
    runtime.clear_plans()
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, seqlen=130, dtype=torch.bfloat16,
                     D="h", z=True, initial_states=True, device="cpu", seed=11)
    kw = _call_key_args(case)
    assert eager.call_key(**kw) is None  # nothing kept yet
    key = eager.call_key(**kw, first=True)
    a = _forward_args(case)
    tensors = (kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"], kw["initial_states"])
    with emulated_kernels():
        y0, fin0 = _launchers_forward(case)
        y1, fin1 = planned.planned_forward(*a, call_key=key)
        assert planned.CALL_PLANS.get(key) is not None and eager.call_key(**kw) == key
        y2, fin2 = eager.remembered_call(key, *tensors)
        assert torch.equal(y1, y0) and torch.equal(fin1, fin0) and torch.equal(y2, y0) and torch.equal(fin2, fin0)

        grads = [t.detach().clone().requires_grad_() if i == 0 else t for i, t in enumerate(tensors)]
        assert eager.remembered_call(key, *grads) is None
        with torch.no_grad():
            assert eager.remembered_call(key, *grads) is not None
        with torch.autograd.profiler.profile():
            assert eager.remembered_call(key, *tensors) is None

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
        with Mode():
            assert eager.remembered_call(key, *tensors) is None
        with config.override(state_block=1024):  # a knob is part of the key: the kept plan is not this call's
            other = eager.call_key(**kw)
            assert other != key and eager.remembered_call(other, *tensors) is None
        monkeypatch.setattr(planned, "forward_plan_current", lambda fp: False)  # the tuning entry changed
        assert eager.remembered_call(key, *tensors) is None
    monkeypatch.undo()

    assert eager.remembered_call(("another",), *tensors) is None
    for change in (dict(seq_idx=torch.zeros(1, 130, dtype=torch.int32)), dict(cu_seqlens=torch.tensor([0, 130])),
                   dict(return_varlen_states=True), dict(dt_limit=list(kw["dt_limit"])),
                   dict(x=kw["x"].as_subclass(_Sub)), dict(dt_softplus=1), dict(chunk_size=True),
                   dict(chunk_size=[64]), dict(dt_limit=([0.0], 1.0))):
        assert eager.call_key(**_call_key_args(case, **change), first=True) is None, change
    x = kw["x"]
    for change in (dict(x=x.float()), dict(x=x[:, :-1]), dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)),
                   dict(chunk_size=32), dict(dt_softplus=not kw["dt_softplus"]), dict(dt_limit=(0, float("inf"))),
                   dict(return_final_states=False), dict(D=None), dict(A=torch.nn.Parameter(kw["A"]))):
        other = eager.call_key(**_call_key_args(case, **change), first=True)
        assert other is not None and other != key, change
    assert not planned.CALL_PLANS  # the emulator's exit cleared every plan


def test_planned_forward_leaves_other_calls_to_the_launchers(monkeypatch):
    """No plan runs where the launchers would convert an input, where the configuration is the fused path, under
    the profiler, or for a non-contiguous input; the launchers' results are the same. A changed knob gets a plan of
    its own."""
    knobs(monkeypatch, segments=False)
    case = make_case(nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=64, seqlen=100, dtype=torch.bfloat16,
                     D="h", device="cpu", seed=3)
    with emulated_kernels():
        assert planned.planned_forward(*_forward_args(case)) is not None
        # C in another dtype than x: the launchers would promote; a plan without `out` is kept for the signature
        mixed = {**case, "C": case["C"].float()}
        assert planned.planned_forward(*_forward_args(mixed)) is None
        assert any(fp.out is None for fp in planned.FORWARD_PLANS.values())
        # x transposed in memory: not contiguous
        xt = case["x"].transpose(1, 2).contiguous().transpose(1, 2)
        assert planned.planned_forward(*_forward_args({**case, "x": xt})) is None
        kept = len(planned.FORWARD_PLANS)
        with config.override(state_block=1024):
            assert planned.planned_forward(*_forward_args(case)) is not None
        assert len(planned.FORWARD_PLANS) == kept + 1
        with torch.autograd.profiler.profile():
            assert planned.planned_forward(*_forward_args(case)) is None
        # the fused scan as the configuration (a knob of the signature: a new plan, without `out`)
        knobs(monkeypatch, segments=True)
        assert planned.planned_forward(*_forward_args(case)) is None


def test_planned_forward_follows_the_tuning_cache(monkeypatch, tmp_path):
    """On a tuned call a plan follows chunk_scan's entry in the tuning cache: none while a search may still run,
    the stored configuration once there is one (sub-chunks included), a new plan when the entry changes, and the
    launchers when the entry is the fused path. With tuning off and no entry, the plan is made on the default and
    dropped when tuning is turned on."""
    from m2ops.kernels import autotune
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(path))
    monkeypatch.setenv("M2OPS_AUTOTUNE", "1")
    monkeypatch.setattr(scan, "tuned", lambda x: True)
    monkeypatch.setattr(autotune, "environment_key", lambda device_index=0: "test-gpu")
    autotune.forget()
    case = make_case(nheads=2, ngroups=1, headdim=16, dstate=32, chunk_size=64, seqlen=200, dtype=torch.bfloat16,
                     initial_states=True, device="cpu", seed=9)
    a = _forward_args(case)
    # sub-chunks of 32 among the candidates (a stored configuration outside them is ignored)
    monkeypatch.setattr(scan, "SUB_CHUNKS", (32, 64, 128))
    shape_key = scan.chunk_scan_shape_key(case["x"], 64, case["B"], None, None, None)

    def store(config):
        _, candidates = scan.kept_scan_configs(1, 200, 2, 16, 32, 64, case["x"].device)
        assert config in candidates
        key = autotune.full_key("chunk_scan", shape_key, candidates=candidates)
        path.write_text(json.dumps({key: {"config": config}}))
        autotune.forget()

    def plan_config():
        (fp,) = planned.FORWARD_PLANS.values()
        return fp.config if fp.out is not None else None

    try:
        with emulated_kernels():
            assert planned.planned_forward(*a) is None and not planned.FORWARD_PLANS  # a search may run
            store({"path": "split", "state_block": 512})
            y, fin = planned.planned_forward(*a)
            assert plan_config() == {"path": "split", "state_block": 512}
            store({"path": "split", "state_block": 1024})
            y2, fin2 = planned.planned_forward(*a)
            assert plan_config() == {"path": "split", "state_block": 1024}
            assert torch.equal(y, y2) and torch.equal(fin, fin2)  # the block only splits the same work
            # a sub-chunk configuration: planned at 32 throughout (chunk_cumsum included), with the bits of the
            # launchers called at 32, and within rounding of the launchers' own path under the same entry
            # (chunk_cumsum at 64, rechunked)
            store({"path": "split", "state_block": 512, "chunk": 32})
            y3, fin3 = planned.planned_forward(*a)
            assert plan_config() == {"path": "split", "state_block": 512, "chunk": 32}
            (fp,) = planned.FORWARD_PLANS.values()
            assert fp.states.states_shape[1] == shapes.num_chunks(200, 32)
            assert fp.cumsum_shape[2:] == (shapes.num_chunks(200, 32), 32)
            y4, fin4 = _launchers_forward_at(case, 32)
            assert torch.equal(y3, y4) and torch.equal(fin3, fin4)
            y4r, fin4r = _launchers_forward(case)
            assert rel_err(y3, y4r) <= 1e-5 and rel_err(fin3, fin4r) <= 1e-5  # the cumulative sums' rounding
            assert rel_err(y3, y) <= 2e-2 and rel_err(fin3, fin) <= 2e-2  # another chunking: rounding apart
            # a super-chunk configuration likewise (chunk_cumsum at 256, not carried over from 64)
            store({"path": "split", "state_block": 512, "chunk": 256})
            y5, fin5 = planned.planned_forward(*a)
            (fp,) = planned.FORWARD_PLANS.values()
            assert fp.states.states_shape[1] == 1 and fp.cumsum_shape[2:] == (1, 256)
            y6, fin6 = _launchers_forward_at(case, 256)
            assert torch.equal(y5, y6) and torch.equal(fin5, fin6)
            y6r, fin6r = _launchers_forward(case)
            # the carry (dstate 64) walks the 256 rows in one float32 state: the rounding grows a little
            assert rel_err(y5, y6r) <= 5e-5 and rel_err(fin5, fin6r) <= 1e-5
            assert rel_err(y5, y) <= 2e-2 and rel_err(fin5, fin) <= 2e-2
            store({"path": "fused", "ppsm": 4})
            assert planned.planned_forward(*a) is None and plan_config() is None
            path.unlink()
            autotune.forget()
            monkeypatch.setenv("M2OPS_AUTOTUNE", "0")
            assert planned.planned_forward(*a) is not None
            (fp,) = planned.FORWARD_PLANS.values()
            assert fp.from_default
            monkeypatch.setenv("M2OPS_AUTOTUNE", "1")
            assert planned.planned_forward(*a) is None and not planned.FORWARD_PLANS
    finally:
        autotune.forget()
