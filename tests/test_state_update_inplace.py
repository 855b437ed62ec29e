"""m2ops.selective_state_update (mamba_ssm's meaning: the state cache updated in place, y returned) and its op
m2ops::state_update_inplace, on the CPU: against the float64 naive recurrence (one step, and a scan's prefill
followed by decode steps against one recurrence over the whole sequence), cache rows picked by
state_batch_indices with padding slots, rows no index names untouched, out=, mamba_ssm's broadcast forms, errors
(nothing written), opcheck, torch.compile(fullgraph=True), and a hypothesis sweep against the functional op on the
gathered rows. The kernel: tests/test_emulated_decode.py (emulator) and tests/gpu/test_state_update_kernel.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import m2ops
from conftest import TOL, assert_close_rel
from m2ops.reference.naive import naive_scan
from test_state_update import CASES, decode_inputs, naive_step

INF = float("inf")


def _state_tol(dtype):
    return TOL[torch.float64 if dtype == torch.float64 else torch.float32]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_updates_state_in_place_like_the_naive_step(case, dtype):
    opts, softplus, limit = CASES[case]
    inp = decode_inputs(dtype=dtype, softplus=softplus, **opts)
    before = {k: (v.clone() if v is not None else None) for k, v in inp.items()}
    state, ptr = inp["state"], inp["state"].data_ptr()
    want_y, want_state = naive_step(before, softplus, limit)
    y = m2ops.selective_state_update(**inp, dt_softplus=softplus, dt_limit=limit)
    assert y.dtype == dtype and y.shape == inp["x"].shape and y.is_contiguous()
    assert state.data_ptr() == ptr and state.dtype == before["state"].dtype
    assert_close_rel(y, want_y, TOL[dtype], "y")
    assert_close_rel(state, want_state, _state_tol(dtype), "state")
    for k, v in before.items():  # everything but the state is only read
        if k != "state" and v is not None:
            assert torch.equal(inp[k], v), k
    # the functional op's bits
    y_f, new_f = m2ops.selective_state_update_functional(**before, dt_softplus=softplus, dt_limit=limit)
    assert torch.equal(y, y_f) and torch.equal(state, new_f)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_then_decode_equals_one_recurrence(dtype):
    """A scan over the prompt (its final state seeding the cache), then token-by-token in-place updates of a
    cache whose rows the batch reaches through state_batch_indices, reproduce the float64 recurrence over the
    whole sequence: every output token and the final state."""
    gen = torch.Generator().manual_seed(5)
    b, T, T0, h, p, g, n = 3, 19, 12, 4, 4, 2, 8

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    x, z, dt = r(b, T, h, p), r(b, T, h, p), r(b, T, h)
    A = -(torch.rand(h, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    B, C = r(b, T, g, n), r(b, T, g, n)
    D, bias, s0 = r(h), r(h), r(b, h, p, n)
    kw = dict(D=D, dt_bias=bias, dt_softplus=True, dt_limit=(0.01, 2.0))
    want_y, want_final, _ = naive_scan(x, dt, A, B, C, z=z, initial_states=s0, **kw)

    y0, prefill = m2ops.mamba_chunk_scan_combined(x[:, :T0], dt[:, :T0], A, B[:, :T0], C[:, :T0], 4, z=z[:, :T0],
                                                  initial_states=s0, return_final_states=True, **kw)
    rows = torch.tensor([4, 0, 2])
    cache = torch.zeros(6, h, p, n, dtype=prefill.dtype)
    cache[rows] = prefill
    others = cache[[1, 3, 5]].clone()
    ys = [y0]
    for t in range(T0, T):
        ys.append(m2ops.selective_state_update(cache, x[:, t], dt[:, t], A, B[:, t], C[:, t], z=z[:, t],
                                               state_batch_indices=rows, **kw)[:, None])
    tol = TOL[dtype] * (10 if dtype == torch.float32 else 1)
    assert_close_rel(torch.cat(ys, 1), want_y, tol, "y")
    assert_close_rel(cache[rows], want_final, tol, "final state")
    assert torch.equal(cache[[1, 3, 5]], others)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_out", [False, True])
def test_state_batch_indices_padding_and_untouched_rows(index_dtype, with_out):
    inp = decode_inputs(b=4, D="hp", z=True, dt_bias=True, seed=2)
    cache = torch.randn(7, *inp["state"].shape[1:], generator=torch.Generator().manual_seed(9))
    rows = torch.tensor([5, -1, 0, 3], dtype=index_dtype)
    used = [0, 2, 3]
    sentinel = torch.full_like(inp["x"], 7.0)
    out = sentinel.clone() if with_out else None
    want_y, want_new = m2ops.selective_state_update_functional(**(inp | dict(state=cache[rows.clamp(min=0)])),
                                                               dt_softplus=True)
    before = cache.clone()
    y = m2ops.selective_state_update(**(inp | dict(state=cache)), dt_softplus=True, state_batch_indices=rows,
                                     out=out)
    if with_out:
        assert y is out
    assert torch.equal(y[used], want_y[used])
    assert torch.equal(y[1], sentinel[1] if with_out else torch.zeros_like(y[1]))  # the padding slot's row
    assert torch.equal(cache[rows[used].long()], want_new[used])
    untouched = [1, 2, 4, 6]
    assert torch.equal(cache[untouched], before[untouched])


def test_every_row_a_padding_slot_writes_nothing():
    inp = decode_inputs(b=2)
    cache = torch.randn(3, *inp["state"].shape[1:])
    before = cache.clone()
    out = torch.full_like(inp["x"], 3.0)
    m2ops.selective_state_update(**(inp | dict(state=cache)), state_batch_indices=torch.tensor([-1, -5]), out=out)
    assert torch.equal(cache, before) and torch.equal(out, torch.full_like(out, 3.0))


def test_unchecked_index_beyond_the_cache_is_skipped(monkeypatch):
    """With the value checks off (as on a GPU, or M2OPS_CHECK_VALUES=0), an index >= cache_rows is skipped like a
    padding slot, in the reference as in the kernel: nothing outside the cache is read or written."""
    monkeypatch.setenv("M2OPS_CHECK_VALUES", "0")
    inp = decode_inputs(b=2)
    cache = torch.randn(3, *inp["state"].shape[1:])
    before = cache.clone()
    want_y, want_new = m2ops.selective_state_update_functional(**(inp | dict(state=cache[[1, 1]])))
    y = m2ops.selective_state_update(**(inp | dict(state=cache)), state_batch_indices=torch.tensor([1, 3]))
    assert torch.equal(y[0], want_y[0]) and torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(cache[1], want_new[0]) and torch.equal(cache[[0, 2]], before[[0, 2]])


def test_out_receives_y_without_indices():
    inp = decode_inputs(D="h", z=True)
    want_y, _ = m2ops.selective_state_update_functional(**(inp | dict(state=inp["state"].clone())))
    out = torch.empty(inp["x"].shape[::-1]).transpose(0, 2)  # another layout: written through its strides
    assert m2ops.selective_state_update(**inp, out=out) is out
    assert torch.equal(out, want_y)


def test_strided_cache_is_updated_where_it_lies():
    """A cache that is a view into a larger buffer (one layer of a per-model cache, a transposed layout) is
    updated in place through its strides, the rest of the buffer untouched."""
    inp = decode_inputs(b=2, n=16)
    buf = torch.randn(2, 3, 16, *inp["state"].shape[1:3])  # (layers, rows, dstate, heads, headdim)
    cache = buf[1].permute(0, 2, 3, 1)  # (rows, heads, headdim, dstate), last stride not 1
    before = buf.clone()
    rows = torch.tensor([2, 0])
    want_y, want_new = m2ops.selective_state_update_functional(**(inp | dict(state=cache[rows].clone())))
    y = m2ops.selective_state_update(**(inp | dict(state=cache)), state_batch_indices=rows)
    assert torch.equal(y, want_y) and torch.equal(cache[rows], want_new)
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[1][1], before[1][1])


def test_mamba_ssm_broadcast_arguments():
    inp = decode_inputs(D="h", dt_bias=True)
    h, p, n = inp["A"].shape[0], inp["x"].shape[2], inp["B"].shape[2]
    s1, s2 = inp["state"].clone(), inp["state"].clone()
    want = m2ops.selective_state_update(**(inp | dict(state=s1)), dt_softplus=True)
    got = m2ops.selective_state_update(
        s2, inp["x"], inp["dt"][..., None].expand(-1, -1, p), inp["A"][:, None, None].expand(h, p, n),
        inp["B"], inp["C"], D=inp["D"][:, None].expand(h, p), dt_bias=inp["dt_bias"][:, None].expand(h, p),
        dt_softplus=True)
    assert torch.equal(got, want) and torch.equal(s1, s2)


def _bad(**changes):
    inp = decode_inputs(b=3, D="h", z=True, dt_bias=True)
    inp["state"] = torch.randn(5, *inp["state"].shape[1:])
    inp["state_batch_indices"] = torch.tensor([4, -1, 0])
    inp["out"] = torch.full_like(inp["x"], 2.0)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("name,changes,kind", [
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([1.0, 2.0, 3.0])), TypeError),
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([1, 2])), ValueError),
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([[1, 2, 3]])), ValueError),
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([1, 5, 0])), ValueError),  # beyond the cache
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([1, -1, 1])), ValueError),  # a repeated row
    ("state_batch_indices", dict(state_batch_indices=torch.tensor([0, 1, 2], device="meta")), ValueError),
    ("state", dict(state=torch.randn(5, 4, 8, 15)), ValueError),
    ("state", dict(state=torch.randn(0, 4, 8, 16)), ValueError),
    ("state", dict(state_batch_indices=None), ValueError),  # 5 cache rows for batch 3 without indices
    ("state", dict(state=torch.randn(1, 4, 8, 16).expand(5, 4, 8, 16)), ValueError),  # written: not expanded
    ("out", dict(out=torch.zeros(3, 4, 7)), ValueError),
    ("out", dict(out=torch.zeros(3, 4, 8, dtype=torch.float64)), TypeError),
    ("out", dict(out=torch.zeros(3, 4, 8, device="meta")), ValueError),
    ("out", dict(out=torch.zeros(1, 4, 8).expand(3, 4, 8)), ValueError),
    ("out", dict(out="out"), TypeError),
    ("x", dict(x=torch.randn(3, 4)), ValueError),
    ("dt_limit", dict(dt_limit=(1.0, 0.5)), ValueError),
])
def test_bad_inputs_name_the_argument_and_write_nothing(name, changes, kind):
    inp = _bad(**changes)
    kw = dict(dt_softplus=True, dt_limit=inp.pop("dt_limit", (0.0, INF)))
    state, out = inp["state"], inp["out"]
    state_before = state.clone() if state.device.type == "cpu" else None
    out_before = out.clone() if isinstance(out, torch.Tensor) and out.device.type == "cpu" else None
    with pytest.raises(kind, match=rf"m2ops.selective_state_update: {name} must"):
        m2ops.selective_state_update(**inp, **kw)
    if state_before is not None:
        assert torch.equal(state, state_before)
    if out_before is not None:
        assert torch.equal(out, out_before)


def _op_args(inp, rows, out, softplus=True, lo=0.0, hi=INF):
    return (inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"],
            rows, softplus, lo, hi, out)


@pytest.mark.parametrize("case", ["plain", "all_options", "D_h_limit"])
@pytest.mark.parametrize("indexed", [False, True])
def test_opcheck(case, indexed):
    opts, softplus, (lo, hi) = CASES[case]
    inp = decode_inputs(dtype=torch.float32, softplus=softplus, b=3, h=4, p=4, n=8, **opts)
    rows = None
    if indexed:
        inp["state"] = torch.randn(5, 4, 4, 8)
        rows = torch.tensor([3, -1, 0])
    torch.library.opcheck(torch.ops.m2ops.state_update_inplace.default,
                          _op_args(inp, rows, torch.zeros_like(inp["x"]), softplus, lo, hi))
    # A given as A_log (the layer's decode step)
    args = _op_args(inp, rows, torch.zeros_like(inp["x"]), softplus, lo, hi)
    torch.library.opcheck(torch.ops.m2ops.state_update_inplace.default,
                          args[:3] + (torch.log(-inp["A"]),) + args[4:], {"A_is_log": True})


def test_compile_fullgraph(reset_dynamo):
    """The public function in one graph (checks, the output's allocation, the op with its declared writes): the
    eager call's bits, the same cache writes."""
    inp = decode_inputs(b=3, D="h", z=True, dt_bias=True)
    cache = torch.randn(5, *inp["state"].shape[1:], generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([4, -1, 1])

    def fn(cache, out, **kw):
        return m2ops.selective_state_update(cache, **kw, dt_softplus=True, state_batch_indices=rows, out=out)

    kw = {k: v for k, v in inp.items() if k != "state"}
    c1, c2 = cache.clone(), cache.clone()
    o1, o2 = torch.full_like(inp["x"], 5.0), torch.full_like(inp["x"], 5.0)
    got = torch.compile(fn, fullgraph=True)(c1, o1, **kw)
    want = fn(c2, o2, **kw)
    assert torch.equal(got, want) and torch.equal(c1, c2) and torch.equal(o1, o2)
    # without out and indices: a fresh y, the whole cache updated
    fresh = torch.compile(lambda s, **kw: m2ops.selective_state_update(s, **kw), fullgraph=True)
    s1, s2 = inp["state"].clone(), inp["state"].clone()
    assert torch.equal(fresh(s1, **kw), m2ops.selective_state_update(s2, **kw)) and torch.equal(s1, s2)


def test_dispatch_runs_the_launcher_where_kernels_serve(monkeypatch):
    """The op's CUDA implementation calls m2ops.kernels.state_update_inplace with the op's arguments where
    dispatch.kernels_serve says so (CPU tensors standing in, a launcher stood in), else the reference."""
    import sys
    import types

    from m2ops.ops import dispatch
    from m2ops.reference import state_update as ref

    launched = []
    fake = types.ModuleType("m2ops.kernels")
    fake.state_update_inplace = lambda *a: launched.append(a) or ref.state_update_inplace(*a)
    monkeypatch.setitem(sys.modules, "m2ops.kernels", fake)
    monkeypatch.setattr(m2ops, "kernels", fake, raising=False)
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: True)
    impl = dispatch.cuda_impl("state_update_inplace", ref.state_update_inplace,
                              lambda state, x, dt, A, B, C, D, z, *_: (None, (state, x, dt, B, C, z), True))
    for dtype, served in ((torch.float32, True), (torch.float64, False)):
        inp = decode_inputs(dtype=dtype, D="h", z=True, dt_bias=True)
        want_state, want_out = inp["state"].clone(), torch.zeros_like(inp["x"])
        ref.state_update_inplace(*_op_args(inp | dict(state=want_state), None, want_out))
        out = torch.zeros_like(inp["x"])
        count = len(launched)
        assert impl(*_op_args(inp, None, out)) is None
        assert (len(launched) > count) is served
        assert torch.equal(out, want_out) and torch.equal(inp["state"], want_state)


# ---- hypothesis: shapes, dtypes, layouts, options, indices ----

@st.composite
def decode_problems(draw):
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    g = draw(st.sampled_from([1, 2]))
    b = draw(st.integers(1, 4))
    indexed = draw(st.booleans())
    cache_rows = b + draw(st.integers(0, 3)) if indexed else b
    perm = draw(st.permutations(range(cache_rows)))
    pad = [draw(st.booleans()) for _ in range(b)]
    rows = [-1 - i if p else r for i, (p, r) in enumerate(zip(pad, perm[:b]))] if indexed else None
    return dict(
        dtype=dtype, b=b, h=g * draw(st.integers(1, 3)), p=draw(st.sampled_from([1, 3, 8])), g=g,
        n=draw(st.sampled_from([1, 5, 16, 33])), D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        dt_bias=draw(st.booleans()), softplus=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        state_dtype=draw(st.sampled_from(["float32", "act"])), cache_rows=cache_rows, rows=rows,
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), with_out=draw(st.booleans()),
        transposed_cache=draw(st.booleans()), limit=draw(st.sampled_from([(0.0, INF), (0.01, 0.5)])))


@given(decode_problems())
def test_matches_the_functional_op_on_the_gathered_rows(pr):
    """Whatever the shapes, dtypes, options, cache layout and indices: the used rows get the functional op's new
    state (the same bits), the padding slots and unnamed rows keep theirs, y is the functional op's y on used rows
    and the out's (or zero) elsewhere."""
    inp = decode_inputs(b=pr["b"], h=pr["h"], p=pr["p"], g=pr["g"], n=pr["n"], dtype=pr["dtype"], D=pr["D"],
                        z=pr["z"], dt_bias=pr["dt_bias"], softplus=pr["softplus"], seed=pr["seed"])
    sdt = pr["dtype"] if pr["state_dtype"] == "act" else inp["state"].dtype
    shape = (pr["cache_rows"], *inp["state"].shape[1:])
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(pr["seed"]), dtype=torch.float64).to(sdt)
    if pr["transposed_cache"]:
        cache = cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    rows = None if pr["rows"] is None else torch.tensor(pr["rows"], dtype=pr["index_dtype"])
    used = [i for i in range(pr["b"]) if rows is None or rows[i] >= 0]
    target = list(range(pr["b"])) if rows is None else [int(rows[i]) for i in used]
    target_all = list(range(pr["b"])) if rows is None else [max(int(r), 0) for r in rows]
    want_y, want_new = m2ops.selective_state_update_functional(
        **(inp | dict(state=cache[target_all].clone())), dt_softplus=pr["softplus"], dt_limit=pr["limit"])
    before = cache.clone()
    out = torch.full_like(inp["x"], 3.0) if pr["with_out"] else None
    y = m2ops.selective_state_update(**(inp | dict(state=cache)), dt_softplus=pr["softplus"], dt_limit=pr["limit"],
                                     state_batch_indices=rows, out=out)
    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert torch.equal(y[used], want_y[used])
    assert torch.equal(cache[target], want_new[used])
    skipped = [i for i in range(pr["b"]) if i not in used]
    assert torch.equal(y[skipped], torch.full_like(y[skipped], 3.0 if pr["with_out"] else 0.0))
    others = [r for r in range(pr["cache_rows"]) if r not in target]
    assert torch.equal(cache[others], before[others])
