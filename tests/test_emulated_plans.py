"""The planned forward (m2ops/kernels/planned.py) on the emulator: the fused cumsum launch, the launchers' bits,
remembered calls (eager.call_key / remembered_call), the calls left to the launchers, and the plans' interplay
with the tuning cache. Last (by file name) of the emulated tests: it ends with the check that every launch they
recorded is a compiled specialisation.

The kernels' own code on the CPU through tests/tile_emulator.py, against the reference: what that catches and
misses, and the tolerances, in tests/emulated_cases.py (the helpers shared by tests/test_emulated_*.py). Skipped
when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

from emulated_cases import EXAMPLES, cases, emulated_launches  # noqa: E402  (puts tests/gpu on sys.path)
from gpu_cases import make_case, rel_err  # noqa: E402
from knobs import knobs  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import config, forward, planned, runtime, scan  # noqa: E402
from m2ops.meta import shapes  # noqa: E402


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


# ---- launch coverage: keep this the last test of the last emulated module (files run in name order) ----

def test_every_emulated_launch_is_a_compiled_specialisation():
    """Every launch the emulated tests ran before this one in this process (kernel, compiler options, array dtypes
    and ranks, constants; launches under a profiling override excluded) is one of m2ops.kernels.specs.all_specs(),
    the list the compile test builds for every architecture: a launcher cannot use a dtype or constant combination
    CI never compiled. tile_emulator records every emulated launch of the process (LAUNCHED); this module is the
    last of tests/test_emulated_*.py by name and this test its last, so a run of those files (or of the whole
    suite) checks the launches of all of them: forward, decode, backward, eager and planned."""
    from tile_emulator import LAUNCHED

    from m2ops.kernels import specs
    if not LAUNCHED:
        pytest.skip("no emulated launches recorded in this process (run the tests/test_emulated_*.py modules)")
    known = {s.key() for s in specs.all_specs() if not s.narrow}
    unknown = sorted(LAUNCHED - known, key=str)
    assert not unknown, f"{len(unknown)} launched specialisations are not in all_specs(), e.g. {unknown[:2]}"
