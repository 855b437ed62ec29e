"""The launchers' kept plans (runtime.planned, forward.py, planned.py) and the other host-path savings: a plan is
reused for the same sizes and options, never where a switch or a profiling override changed what the launcher
would choose; absent inputs share one dummy; D per head reaches compute_out as a (nheads, 1) view; the tuning
file is reread only when it changed. The launches are recorded on the CPU, not run (the emulator tests check
results)."""

from __future__ import annotations

import os

import pytest
import torch

from m2ops.kernels import autotune, common, decode, forward, planned, registry, runtime, specialise
from m2ops.reference import chunked as ref  # noqa: E402
from knobs import knobs  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    """The launches made while the fixture is active, as (kernel name, grid, args)."""
    calls = []
    monkeypatch.setattr(runtime, "launch", lambda grid, kernel, args, *rest:
                        calls.append((kernel._pyfunc.__name__, grid, args)))
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    runtime.clear_plans()
    yield calls
    runtime.clear_plans()


def _inputs(T=300, N=64, h=4, p=16, g=2):
    x = torch.randn(1, T, h, p, dtype=torch.bfloat16)
    B = torch.randn(1, T, g, N, dtype=torch.bfloat16)
    dt = torch.rand(1, T, h)
    dt_out, cs = ref.chunk_cumsum(dt, -torch.rand(h), None, 256, True, 0.0, float("inf"))
    return x, B, dt_out, cs


def _state_launch(calls):
    return [c for c in calls if c[0] == "chunk_state_kernel"][-1]


def test_plan_is_kept_and_follows_the_config(recorded, monkeypatch):
    x, B, dt_out, cs = _inputs()
    forward.fwd_pass_state(x, B, dt_out, cs, None, None, None, entering_dtype=torch.bfloat16)
    first = forward.state_plan(1, 300, 4, 16, 2, 64, 256, "bfloat16", False, False, None, True, torch.bfloat16,
                               x.device)
    forward.fwd_pass_state(x, B, dt_out, cs, None, None, None, entering_dtype=torch.bfloat16)
    assert forward.state_plan(1, 300, 4, 16, 2, 64, 256, "bfloat16", False, False, None, True, torch.bfloat16,
                              x.device) is first
    assert _state_launch(recorded)[2][5].dtype == torch.bfloat16  # local states in bfloat16 at chunk 256
    tn = _state_launch(recorded)[2][6 + 8]  # TN: after the 6 arrays and 8 other arguments
    assert tn == specialise.chunk_state_tn(64)

    hb = _state_launch(recorded)[2][6 + 11]  # HB: the last argument
    assert hb == 1  # one head a program up to dstate 64
    with pytest.MonkeyPatch.context() as mp:
        knobs(mp, chunk_state_heads=2)  # a knob: a new plan
        forward.fwd_pass_state(x, B, dt_out, cs, None, None, None, entering_dtype=torch.bfloat16)
        assert _state_launch(recorded)[2][6 + 11] == 2
    forward.fwd_pass_state(x, B, dt_out, cs, None, None, None, entering_dtype=torch.bfloat16)
    assert _state_launch(recorded)[2][6 + 11] == 1
    assert forward.state_plan(1, 300, 4, 16, 2, 64, 256, "bfloat16", False, False, None, True, torch.bfloat16,
                              x.device) is first  # the plan of the first config, kept all along


@pytest.mark.parametrize("dstate,heads_per_group,hb", [(16, 4, 1), (64, 4, 1), (65, 4, 2), (128, 4, 2), (128, 3, 1)])
def test_chunk_state_heads_follow_dstate(dstate, heads_per_group, hb):
    """bfloat16 at chunk 256: two heads per chunk_state program from dstate 65 where a group's heads divide by two,
    one up to CHUNK_STATE_ONE_HEAD_MAX_DSTATE (and where they do not divide); the grid follows the choice."""
    h = 2 * heads_per_group
    plan = forward.state_plan(1, 1024, h, 64, 2, dstate, 256, "bfloat16", False, False, None, True, torch.bfloat16,
                              torch.device("cpu"))
    step = plan.chunk_state
    assert step.tail[-1] == hb  # HB, the last constant
    n_tiles = common.cdiv(dstate, specialise.chunk_state_tn(dstate))
    assert step.grid[0] == 4 * (h // hb) * 1 * n_tiles  # chunks x head groups x headdim tiles x dstate tiles


@pytest.mark.parametrize("carry", [False, True])
def test_dummies_are_shared_and_d_per_head_is_a_view(recorded, monkeypatch, carry):
    """For both of compute_out's kernels (D, z, seq_idx and has_d sit at the same places in each)."""
    knobs(monkeypatch, out_carry=carry)
    name = "compute_out_carry_kernel" if carry else "compute_out_kernel"
    x, B, dt_out, cs = _inputs()
    states = torch.zeros(1, 2, 4, 16, 64, dtype=torch.bfloat16)
    D = torch.rand(4)
    forward.compute_out(x, dt_out, cs, B, B, states, D, None, None)
    forward.compute_out(x, dt_out, cs, B, B, states, D, None, None)
    a, b = [c[2] for c in recorded if c[0] == name]
    assert a[8] is b[8]  # seq_idx absent: the same dummy each call
    Dk, has_d = a[6], a[15]
    assert has_d == 1 and Dk.shape == (4, 1) and Dk.data_ptr() == D.data_ptr()  # no copy
    Dhp = torch.rand(4, 16)
    forward.compute_out(x, dt_out, cs, B, B, states, Dhp, None, None)
    c = [c[2] for c in recorded if c[0] == name][-1]
    assert c[15] == 2 and c[6].shape == (4, 16)
    forward.compute_out(x, dt_out, cs, B, B, states, None, None, None)
    assert [c[2] for c in recorded if c[0] == name][-1][15] == 0


def test_tuning_file_is_reread_only_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text("{}")
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(path))
    autotune.forget()
    loads = []
    real = autotune._load
    monkeypatch.setattr(autotune, "_load", lambda: loads.append(1) or real())
    for _ in range(5):
        assert autotune.lookup("absent") is None
    assert len(loads) == 1
    path.write_text('{"k": {"config": {"a": 1}}}')
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # a later modification time
    clock = [autotune.time.monotonic()]
    monkeypatch.setattr(autotune.time, "monotonic", lambda: clock[0])
    stats = []
    real_stamp = autotune._stamp
    monkeypatch.setattr(autotune, "_stamp", lambda p: stats.append(1) or real_stamp(p))
    # within RECHECK_S of the last look: the file is not even looked at
    assert autotune.lookup("k") is None and not stats and len(loads) == 1
    clock[0] += autotune.RECHECK_S
    assert autotune.lookup("k") == {"a": 1}
    assert len(loads) == 2 and len(stats) == 1
    # another path is looked at at once
    other = tmp_path / "other.json"
    other.write_text('{"k2": {"config": {"b": 2}}}')
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(other))
    assert autotune.lookup("k2") == {"b": 2}
    autotune.forget()


def test_scratch_layout_lays_buffers_apart_and_aligned():
    """A ForwardPlan's five scratch buffers come from one allocation (planned.scratch_layout, _scratch_views): each
    view has its dtype and shape, starts on a multiple of 512 bytes, and no two overlap."""
    specs = ((torch.float32, (1, 80, 3, 256)), (torch.float32, (1, 80, 3, 256)), (torch.bfloat16, (1, 3, 80, 7, 9)),
             None, (torch.bfloat16, (1, 3, 1, 4, 4, 64, 64)))
    layout, total = planned.scratch_layout(specs)
    views = planned.scratch_views(layout, total, torch.device("cpu"))
    assert views[3] is None and layout[3] is None
    spans = []
    for spec, v in zip(specs, views):
        if spec is None:
            continue
        assert v.dtype == spec[0] and tuple(v.shape) == spec[1] and v.is_contiguous()
        start = v.data_ptr() - views[0].data_ptr()
        assert start % 512 == 0
        spans.append((start, start + v.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= total
    assert views[2].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()  # one allocation


def test_planned_forward_allocates_three_times(recorded, monkeypatch):
    """A planned forward allocates its scratch once, then y and the final states: three torch.empty calls, where
    the launchers make seven (each costs the H200's host 5-9 us)."""
    knobs(monkeypatch, segments=False)
    x, B, _, _ = _inputs(T=200, N=32, h=4, p=16, g=1)
    a = (x, torch.rand(1, 200, 4), -torch.rand(4), B, torch.randn_like(B), 64, torch.rand(4), None, torch.rand(4),
         torch.randn(1, 4, 16, 32), True, 0.0, float("inf"))
    assert planned.planned_forward(*a) is not None  # the plan is made on the first call
    made = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kw: made.append(1) or real(*args, **kw))
    planned.planned_forward(*a)
    assert len(made) == 3 and [c[0] for c in recorded[-5:]] == [
        "chunk_cumsum_kernel", "chunk_state_kernel", "state_passing_kernel", "chunk_cb_kernel", "compute_out_kernel"]


def test_hinted_kernel_keeps_the_table_choice():
    """hinted_kernel gives the table's hinted object, one per key, kept."""
    table = specialise.hinted_kernel("compute_out", "bfloat16", 256)
    assert table is specialise.hinted("compute_out", tuple(sorted(specialise.kernel_hints("compute_out", "bfloat16",
                                                                                   256).items())))
    assert specialise.hinted_kernel("chunk_cumsum", "float32", 256) is registry.KERNELS["chunk_cumsum"]  # no entry
    # an entry at every chunk size for 16-bit activations, none for float32 ones
    assert specialise.kernel_hints("chunk_cb", "float16", 32) == specialise.kernel_hints("chunk_cb", "bfloat16", 256) != {}
    assert specialise.hinted_kernel("chunk_cb", "float32", 256) is registry.KERNELS["chunk_cb"]
    assert specialise.hinted_kernel("compute_out", "bfloat16", 256) is table


def test_state_update_hints_follow_the_rows_alignment(monkeypatch):
    """state_update launches the occupancy-4 build only where every tiled array has 16-byte rows (headdim 64,
    dstate 128 in bfloat16); the table's build at headdim 50 or dstate 100 (rows of 100 or 200 bytes), for a
    view that starts off a 16-byte boundary."""
    kernels = []
    monkeypatch.setattr(runtime, "launch", lambda grid, kernel, args, *rest: kernels.append(kernel))
    aligned = specialise.hinted("state_update", (("occupancy", decode.STATE_UPDATE_ALIGNED_OCCUPANCY),))
    table = specialise.hinted_kernel("state_update", "bfloat16", 0)
    assert aligned is not table

    def step(p, n, d_shape=(), offset=0, b=2, h=4, g=2):
        bf = dict(dtype=torch.bfloat16)
        state = torch.randn(b * h * p * n + offset, **bf)[offset:].view(b, h, p, n)
        D = torch.rand(h, *d_shape) if d_shape else None
        decode.state_update(state, torch.randn(b, h, p, **bf), torch.rand(b, h, **bf), -torch.rand(h),
                            torch.randn(b, g, n, **bf), torch.randn(b, g, n, **bf), D, torch.randn(b, h, p, **bf),
                            None, True, 0.0, float("inf"))
        return kernels[-1]

    assert step(64, 128) is aligned
    assert step(64, 128, d_shape=(64,)) is aligned  # D per channel, rows of 256 bytes
    assert step(50, 128) is table  # x, y, z rows of 100 bytes
    assert step(64, 100) is table  # state rows of 200 bytes
    assert step(56, 32) is aligned  # rows of 112 and 64 bytes
    assert step(64, 128, offset=1) is table  # the state starts 2 bytes off


def test_state_update_inplace_hints_follow_the_rows_alignment(monkeypatch):
    """The in-place decode kernel takes state_update's rule: the occupancy-4 build where every tiled array (the
    cache, x, B, C, z, D, out) has 16-byte rows, the table's elsewhere; the indices do not count (read as one
    value per program)."""
    kernels = []
    monkeypatch.setattr(runtime, "launch", lambda grid, kernel, args, *rest: kernels.append(kernel))
    aligned = specialise.hinted("state_update_inplace", (("occupancy", decode.STATE_UPDATE_ALIGNED_OCCUPANCY),))
    table = specialise.hinted_kernel("state_update_inplace", "bfloat16", 0)
    assert aligned is not table

    def step(p, n, offset=0, rows=None, b=2, h=4, g=2):
        bf = dict(dtype=torch.bfloat16)
        cache_rows = b if rows is None else 5
        state = torch.randn(cache_rows * h * p * n + offset)[offset:].view(cache_rows, h, p, n)
        decode.state_update_inplace(state, torch.randn(b, h, p, **bf), torch.rand(b, h, **bf), -torch.rand(h),
                                    torch.randn(b, g, n, **bf), torch.randn(b, g, n, **bf), None,
                                    torch.randn(b, h, p, **bf), None, rows, True, 0.0, float("inf"),
                                    torch.empty(b, h, p, **bf))
        return kernels[-1]

    assert step(64, 128) is aligned
    assert step(64, 128, rows=torch.tensor([3, -1])) is aligned
    assert step(50, 128) is table  # x, y, z rows of 100 bytes
    assert step(64, 100) is table  # B and C rows of 200 bytes
    assert step(64, 128, offset=1) is table  # the cache starts 4 bytes off


@pytest.mark.parametrize("rmsnorm", [True, False])
def test_layer_decode_step_takes_the_aligned_state_update_build(monkeypatch, rmsnorm):
    """The arrays m2ops.Mamba2.step hands the in-place decode op (x, B, C, z as views into its projections and
    convolution output, the float32 state cache, y) have 16-byte rows at a usual size (headdim 64, dstate 128, 8
    heads), so on the GPU the step runs state_update_inplace's occupancy-4 build, the one docs/layer.md's decode
    times are for."""
    import m2ops
    from m2ops import layer as layer_mod

    seen = {}
    real = layer_mod.ops.state_update_inplace

    def spy(state, x, dt, A, B, C, D, z, *rest, **kwargs):
        seen.update(state=state, x=x, B=B, C=C, z=z, D=D, out=rest[-1])
        return real(state, x, dt, A, B, C, D, z, *rest, **kwargs)

    monkeypatch.setattr(layer_mod.ops, "state_update_inplace", spy)
    mixer = m2ops.Mamba2(d_model=256, d_state=128, headdim=64, rmsnorm=rmsnorm, dtype=torch.bfloat16)
    conv_state, ssm_state = mixer.allocate_inference_cache(2)
    mixer.step(torch.randn(2, 1, 256, dtype=torch.bfloat16), conv_state, ssm_state)
    assert (seen["z"] is None) == rmsnorm and seen["x"].shape == (2, 8, 64) and seen["B"].shape == (2, 1, 128)
    tiled = [seen[k] for k in ("state", "x", "B", "C", "z", "out") if seen[k] is not None]
    assert not all(t.is_contiguous() for t in tiled[1:])  # views into the projections, as on the GPU
    assert decode.rows_of_16_bytes(*tiled)


def test_scratch_is_kept_per_stream_and_thread_never_under_capture(monkeypatch):
    """_planned_scratch: a CUDA call's scratch views are kept for the next call with the same layout on the same
    stream from the same thread; another stream, another thread or another layout gets its own; under graph
    capture, and for a scratch larger than the budget, nothing is kept; the least recently used entries go when
    the kept total passes the budget; clear_plans forgets them. (Allocation and streams stubbed: the CPU machine
    has no CUDA; tests/gpu/test_graph_safety.py runs the real thing.)"""
    import threading
    from types import SimpleNamespace
    made = []
    monkeypatch.setattr(planned, "scratch_views", lambda layout, total, device: made.append(total) or (object(),))
    stream, capturing = [7], [False]
    monkeypatch.setattr(planned, "stream_handle", lambda: stream[0])
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0], raising=False)
    monkeypatch.setattr(planned, "SCRATCH_KEEP_BYTES", 1000)
    runtime.clear_plans()
    cuda = SimpleNamespace(type="cuda")

    def plan(nbytes):
        return SimpleNamespace(scratch=(("layout", nbytes),), scratch_bytes=nbytes)

    a, b = plan(400), plan(500)
    first = planned.planned_scratch(a, cuda)
    assert planned.planned_scratch(a, cuda) is first and made == [400]
    assert planned.kept_scratch_bytes() == 400
    stream[0] = 8
    other_stream = planned.planned_scratch(a, cuda)
    assert other_stream is not first and len(made) == 2
    stream[0] = 7
    assert planned.planned_scratch(a, cuda) is first  # (now stream 8's entry is the least recently used)
    got = []
    t = threading.Thread(target=lambda: got.append(planned.planned_scratch(a, cuda)))
    t.start()
    t.join()
    assert got[0] is not first and len(made) == 3
    # 3 x 400 kept would pass 1000: the least recently used (stream 8's) went when the thread's came
    assert planned.kept_scratch_bytes() == 800
    assert planned.planned_scratch(a, cuda) is first
    capturing[0] = True
    assert planned.planned_scratch(a, cuda) is not first and planned.planned_scratch(b, cuda) is not first
    assert len(made) == 5 and planned.kept_scratch_bytes() == 800
    capturing[0] = False
    planned.planned_scratch(plan(1001), cuda)  # over the budget by itself: never kept
    assert planned.kept_scratch_bytes() == 800
    planned.planned_scratch(b, cuda)  # a new layout: kept, and the oldest entries go to make room
    assert planned.kept_scratch_bytes() <= 1000 and planned.planned_scratch(b, cuda) is not None
    n = len(made)
    assert planned.planned_scratch(plan(400), cuda) is not first and len(made) == n + 1  # same size, other layout
    planned.planned_scratch(a, torch.device("cpu"))  # off the GPU: never kept
    assert len(made) == n + 2
    runtime.clear_plans()
    assert planned.kept_scratch_bytes() == 0
