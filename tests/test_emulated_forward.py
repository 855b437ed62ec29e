"""The forward kernels on the emulator: chunk_cumsum, chunk_state / state_passing (fwd_pass_state), compute_out
and its carry, the chunk_scan op (segments, sub- and super-chunks, its tuner), bounds checks and bfloat16
intermediates.

The kernels' own code on the CPU through tests/tile_emulator.py, against the reference: what that catches and
misses, and the tolerances, in tests/emulated_cases.py (the helpers shared by tests/test_emulated_*.py). Skipped
when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

from emulated_cases import SWEEP, cases, check, emulated_launches  # noqa: E402  (puts tests/gpu on sys.path)
from gpu_cases import make_case, reference_forward  # noqa: E402
from knobs import knobs  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import common, config, forward, runtime, scan, specialise  # noqa: E402
from m2ops.meta import shapes  # noqa: E402
from m2ops.reference import chunked as ref  # noqa: E402


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
    check(dt_out, mid["dt_out"], "cumsum", dtype, "dt_out")
    check(cs, mid["dA_cumsum"], "cumsum", dtype, "dA_cumsum")
    check(st_, mid["states"], "states", dtype, "states")
    check(fin, fin_ref, "states", dtype, "final_states")
    check(var, var_ref, "states", dtype, "varlen_states")
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    check(y, y_ref, "y", dtype, "y")


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
    check(y, y_ref, "y", case["x"].dtype, "y")


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
    check(st_, mid["states"], "states", torch.bfloat16, "states")
    check(fin, fin_ref, "states", torch.bfloat16, "final_states")
    check(y, y_ref, "y", torch.bfloat16, "y")


def test_unchecked_load_outside_array_raises(monkeypatch):
    """The emulator's guard for CHK=False: a launcher that promised in-bounds tiles for a ragged shape fails."""
    case = _bf16_case(chunk_size=64, seqlen=100, nheads=2, headdim=64, dstate=64, dt_softplus=False,
                      dt_bias=False, nseqs=1, seed=1)
    _, _, _, mid = reference_forward(case)
    monkeypatch.setattr(specialise, "tiles_in_bounds", lambda *a: True)  # a wrong promise
    with emulated_kernels(), pytest.raises(IndexError, match="check_bounds=False"):
        forward.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                           None, None, None)


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
    check(st_.float(), mid["states"], "states", torch.bfloat16, "entering states")
    check(fin, fin_ref, "states", torch.bfloat16, "final_states")


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
    check(y, y_ref, "y", dtype, "y")
    check(fin, fin_ref, "states", dtype, "final_states")


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
    check(y, y_ref, "y", torch.float32, "y")
    check(fin, fin_ref, "states", torch.float32, "final_states")


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
    check(y, y_ref, "y", dtype, "y")
    check(fin, fin_ref, "states", dtype, "final_states")


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
    check(y, y_ref, "y", dtype, "y")
    check(fin, fin_ref, "states", dtype, "final_states")


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
    check(y, y_ref, "y", torch.float32, "y")
    check(fin, fin_ref, "states", torch.float32, "final_states")
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
    check(y2, y_ref, "y", torch.float32, "y")
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
    check(y, y_ref, "y", torch.bfloat16, "y")


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
    check(st_, mid["states"], "states", torch.bfloat16, "states")
    check(fin, fin_ref, "states", torch.bfloat16, "final_states")


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
    check(fin, fin_ref, "states", torch.bfloat16, "final_states")
    check(y, y_ref, "y", torch.bfloat16, "y")


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
    check(st_.float(), mid["states"], "states", torch.bfloat16, "entering states (bf16)")
    check(y, y_ref, "y", torch.bfloat16, "y")
    check(fin, fin_ref, "states", torch.bfloat16, "final_states")
