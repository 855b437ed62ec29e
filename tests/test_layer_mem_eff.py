"""m2ops.Mamba2's memory-efficient training path (use_mem_eff_path=True: m2ops.mixer_fn, the op m2ops::mixer whose
backward op recomputes the convolution, the dt tensors and the norm) against the plain composition of the ops: the
output and every gradient in float64 on the CPU, under autocast, gradcheck and opcheck of the ops, when the path is
taken, what it keeps for the backward, eager and under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import m2ops
from m2ops.mixer_fn import mixer_fn

from test_layer import SMALL, make_layer

F64 = torch.float64


def uses_mixer(out):
    """Whether out comes from m2ops::mixer (through views only)."""
    fn = out.grad_fn
    while fn is not None and "m2ops_mixer" not in type(fn).__name__:
        fn = fn.next_functions[0][0] if type(fn).__name__ in ("ViewBackward0", "UnsafeViewBackward0") else None
    return fn is not None


# (constructor options on test_layer.SMALL: d_model 16, d_state 8, headdim 8, chunk 8); 21 tokens
CONFIGS = {
    "default": dict(),
    "groups_hdimD_bias": dict(ngroups=2, D_has_hdim=True, bias=True, conv_bias=False, dt_limit=(0.02, 0.3)),
    "norm_before_gate": dict(ngroups=2, norm_before_gate=True, d_conv=3),
    "no_rmsnorm": dict(rmsnorm=False),
    "mlp_part": dict(d_ssm=16, ngroups=2),
    "mlp_part_no_rmsnorm": dict(d_ssm=16, rmsnorm=False, bias=True),
    "chunk_5": dict(chunk_size=5, ngroups=2),
}


def run(m, u, mem_eff, grad_seed=1, **kwargs):
    """(output, gradient of u, of every parameter, of the caches when given) for a random output gradient."""
    m.use_mem_eff_path = mem_eff
    m.zero_grad(set_to_none=True)
    x = u.clone().requires_grad_(True)
    cache = kwargs.pop("cache", None)
    if cache is not None:
        cache = tuple(c.clone().requires_grad_(True) for c in cache)
        kwargs["cache"] = cache
    out = m(x, **kwargs)
    assert uses_mixer(out) == mem_eff
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(g)
    grads = {"u": x.grad, **{k: p.grad for k, p in m.named_parameters()}}
    if cache is not None:
        grads.update({"conv_state": cache[0].grad, "ssm_state": cache[1].grad})
    return out.detach(), grads


def assert_paths_equal(m, u, tol=1e-10, **kwargs):
    want_out, want = run(m, u, False, **kwargs)
    got_out, got = run(m, u, True, **kwargs)
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] is not None and want[k] is not None, k
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("config", CONFIGS)
def test_gradients_equal_plain_path(config):
    m = make_layer(**CONFIGS[config])
    assert_paths_equal(m, torch.randn(2, 21, 16, dtype=F64))


def test_packed_sequences_seq_idx_and_cu_seqlens():
    m = make_layer(ngroups=2, bias=True)
    u = torch.randn(2, 19, 16, dtype=F64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 9 + [2] * 5, [0] * 2 + [3] * 17])
    assert_paths_equal(m, u, seq_idx=seq_idx)
    assert_paths_equal(m, u[:1], cu_seqlens=torch.tensor([0, 5, 14, 19]))


def test_caches_and_flattened_input():
    """forward(u, cache=...) continues from caches (gradients reach them), and the (batch * seqlen, d_model) form."""
    m = make_layer(ngroups=2, d_conv=3)
    g = torch.Generator().manual_seed(3)
    conv_state = torch.randn(2, m.conv_dim, m.d_conv, dtype=F64, generator=g)
    ssm_state = torch.randn(2, m.nheads, m.headdim, m.d_state, dtype=F64, generator=g)
    assert_paths_equal(m, torch.randn(2, 13, 16, dtype=F64), cache=(conv_state, ssm_state))
    assert_paths_equal(m, torch.randn(2 * 9, 16, dtype=F64), seqlen=9)


def test_autocast():
    """Under autocast (bfloat16 on the CPU) out_proj runs in bfloat16 on both paths and every gradient comes back
    in its parameter's dtype; the two paths agree to bfloat16 rounding."""
    m = make_layer(dtype=torch.float32, d_ssm=16, ngroups=2, bias=True)
    u = torch.randn(2, 21, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out, want = run(m, u, False)
        got_out, got = run(m, u, True)
    assert got_out.dtype == want_out.dtype == torch.bfloat16
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        err = ((got[k].double() - want[k].double()).norm() / want[k].double().norm()).item()
        assert err < 2e-2, (k, err)
    err = ((got_out.double() - want_out.double()).norm() / want_out.double().norm()).item()
    assert err < 1e-2, err


def test_path_taken_only_for_training():
    m = make_layer()
    u = torch.randn(1, 9, 16, dtype=F64)
    assert uses_mixer(m(u))
    with torch.no_grad():
        assert m(u).grad_fn is None
    out, _, _ = m(u, return_final_states=True)  # the caches come from the plain path
    assert not uses_mixer(out)
    m.requires_grad_(False)
    assert m(u).grad_fn is None
    assert uses_mixer(m(u.requires_grad_(True)))
    m.requires_grad_(True)
    m.use_mem_eff_path = False
    assert not uses_mixer(m(u))


def tiny_args(rmsnorm, dtype=F64, requires_grad=True):
    """mixer_fn's tensors for a tiny mixer (2 heads of 2 channels, 2 groups of dstate 2, width 3, 6 tokens; an MLP
    part of 2 channels with the norm), and its options."""
    g = torch.Generator().manual_seed(0)
    b, L, h, p, ngroups, n, w, d_mlp, d_model = 1, 6, 2, 2, 2, 2, 3, 2 if rmsnorm else 0, 3
    d_ssm = h * p
    conv_dim = d_ssm + 2 * ngroups * n

    def rnd(*shape, scale=0.5, shift=0.0):
        return (torch.randn(*shape, dtype=F64, generator=g) * scale + shift).to(dtype).requires_grad_(requires_grad)

    tensors = (rnd(b, L, 2 * d_mlp + d_ssm + conv_dim + h, scale=1.0), rnd(conv_dim, w), rnd(conv_dim),
               rnd(h, shift=-1.0), rnd(h, shift=-1.0), rnd(h, p), rnd(d_ssm, shift=1.0) if rmsnorm else None,
               rnd(d_model, d_ssm + d_mlp), rnd(d_model), rnd(b, conv_dim, w - 1), rnd(b, h, p, n))
    options = dict(chunk_size=4, headdim=p, ngroups=ngroups, norm_group_size=p, norm_before_gate=False,
                   seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    return tensors, options


def call(tensors, options):
    *params, conv_init, ssm_init = tensors
    return mixer_fn(*params, conv_initial_states=conv_init, ssm_initial_states=ssm_init, **options)


@pytest.mark.parametrize("rmsnorm", [True, False])
def test_gradcheck(rmsnorm):
    """The op's backward against finite differences, every differentiable input (the caches included)."""
    tensors, options = tiny_args(rmsnorm)
    assert torch.autograd.gradcheck(lambda *t: call(t, options), tensors, eps=1e-6, atol=1e-7, rtol=1e-6,
                                    fast_mode=True)


def test_opcheck():
    """m2ops::mixer and m2ops::mixer_bwd: schema, fake against real, autograd registration, AOT dispatch."""
    tensors, options = tiny_args(True, dtype=torch.float32)
    zx, cw, cb, dt_bias, A, D, nw, ow, ob, conv_init, ssm_init = tensors
    opts = (options["headdim"], options["ngroups"], 4, 0.0, float("inf"), 1e-5, options["norm_group_size"], False)
    args = (zx, cw, cb, dt_bias, A, D, nw, ow, ob, options["seq_idx"], conv_init, ssm_init, *opts)
    torch.library.opcheck(m2ops.ops.mixer, args)
    with torch.no_grad():
        out, y = m2ops.ops.mixer(*args)
    torch.library.opcheck(m2ops.ops.mixer_bwd, (torch.randn_like(out), zx.detach(), y, *(
        t.detach() if isinstance(t, torch.Tensor) else t for t in args[1:])))


def saved_bytes_per_token(fn, u, params):
    """Bytes autograd keeps for the backward of fn(u), per token: every saved tensor's storage counted once,
    the parameters' not (they live anyway). Compiled code saves through autograd too, so the hooks see it."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(u)
    return sum(storages.values()) / (u.shape[0] * u.shape[1]), out


def test_saves_only_zxbcdt_and_y():
    """The memory-efficient path keeps in_proj's input u (in_proj's own save), zxbcdt and y, plus per-head values
    (A); the plain path keeps more (the convolution's output, the norm's output, rstd, dt tensors)."""
    m = make_layer(dtype=torch.float32, d_model=64, d_state=16, headdim=16, chunk_size=16)
    u = torch.randn(2, 64, 64)
    per_token = 4 * (m.d_model + m.in_proj.out_features + m.d_ssm)  # u, zxbcdt, y in float32
    slack = 64  # A and the like: a few (nheads,) tensors, per token over 128 tokens
    m.use_mem_eff_path = False
    plain, _ = saved_bytes_per_token(m, u, m.parameters())
    m.use_mem_eff_path = True
    got, _ = saved_bytes_per_token(m, u, m.parameters())
    assert per_token <= got <= per_token + slack, (got, per_token)
    assert plain > per_token + 4 * m.conv_dim, (plain, per_token)


def test_backward_fills_no_gradient_for_y():
    """y (the scan's output, returned for the backward only) gets no zero-filled gradient from autograd: nothing
    of its size is filled with zeros while the backward runs (it was a (b, L, d_ssm) buffer and a fill kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.new_zeros,
                                       torch.ops.aten.fill_, torch.ops.aten.zero_):
                self.sizes.append(out.numel())
            return out

    m = make_layer(dtype=torch.float32, d_model=64, d_state=16, headdim=16, chunk_size=16)
    out = m(torch.randn(2, 64, 64, requires_grad=True))
    y_numel = 2 * 64 * m.d_ssm
    with Fills() as mode:
        out.backward(torch.randn_like(out))
    assert y_numel not in mode.sizes, mode.sizes


def test_backward_frees_the_states_and_gradients_before_the_later_stages():
    """The layer's backward holds neither the entering states nor their gradient when the scan's per-token stage
    (m2ops::chunk_state_bwd) runs, nor y's gradient (the norm's input gradient) once compute_out_bwd has read it:
    at the training step's peak those were three arrays of 320 MiB at 8 x 4K, d_model 2560 (measure/
    memory_replay.py). Followed here by the storages made during the backward that are alive when each op
    starts, on the CPU (the same composition runs on the GPU)."""
    from torch._library.custom_ops import OPDEFS
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made, self.at = [], {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = f"{func.namespace}::{func._schema.name.split('::')[-1]}"
            self.at[name] = [(shape, dtype) for ref, shape, dtype in self.made if not ref.expired()]
            if func.namespace == "m2ops":  # its implementation under this mode, to see the ops it calls
                with self:
                    out = OPDEFS[name]._init_fn(*args, **(kwargs or {}))
            else:
                out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):
                for o in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(o, torch.Tensor) and o.numel():
                        self.made.append((StorageWeakRef(o.untyped_storage()), tuple(o.shape), o.dtype))
            return out

    # (bfloat16: the local states' gradients between the two stages are bfloat16 then, the states and their
    # gradients float32)
    m = make_layer(dtype=torch.bfloat16, d_model=64, d_state=16, headdim=16, chunk_size=16)
    b, T = 2, 64
    out = m(torch.randn(b, T, 64, dtype=torch.bfloat16, requires_grad=True))
    with Live() as mode:
        out.backward(torch.randn_like(out))
    states = ((b, T // 16, m.nheads, m.headdim, m.d_state), torch.float32)
    assert states in mode.at["m2ops::state_passing_bwd"]  # (what the check below looks for)
    assert states not in mode.at["m2ops::chunk_state_bwd"], mode.at["m2ops::chunk_state_bwd"]
    # the norm's outputs: its input gradient (y's, read by compute_out_bwd) and dz, kept for zxbcdt's gradient
    norm_outputs = mode.at["m2ops::state_passing_bwd"].count(((b, T, m.d_ssm), torch.bfloat16))
    assert norm_outputs == 1, mode.at["m2ops::state_passing_bwd"]


def test_compile_fullgraph_training_step(reset_dynamo):
    """Forward and backward compiled (fullgraph): the results of eager, and no more saved (AOTAutograd would merge
    an autograd.Function's recomputations with the forward's calls and save their results)."""
    m = make_layer(dtype=torch.float32, ngroups=2, d_ssm=16, bias=True)
    u = torch.randn(2, 21, 16)
    seq_idx = torch.tensor([[0] * 8 + [1] * 13, [0] * 21])
    # aot_eager: AOTAutograd's partition is what decides the saved tensors (tests/test_layer.py compiles the
    # layer, this path by default, with inductor)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")

    def loss_and_grads(fn):
        m.zero_grad(set_to_none=True)
        x = u.clone().requires_grad_(True)
        saved, out = saved_bytes_per_token(lambda v: fn(v, seq_idx=seq_idx), x, m.parameters())
        out.square().mean().backward()
        return saved, out.detach(), x.grad, {k: p.grad.clone() for k, p in m.named_parameters()}

    want = loss_and_grads(m)
    got = loss_and_grads(compiled)
    assert 0 < got[0] <= want[0], (got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    for k in want[3]:
        torch.testing.assert_close(got[3][k], want[3][k], rtol=1e-4, atol=1e-5, msg=k)


def test_bad_input_names_the_argument():
    m = make_layer(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"causal_conv1d_fn: cu_seqlens must be strictly increasing"):
        m(torch.randn(1, 5, 16), cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match=r"seq_idx must be non-decreasing"):
        m(torch.randn(1, 5, 16), seq_idx=torch.tensor([[0, 1, 1, 0, 0]]))
    zx = torch.randn(1, 5, 10)
    with pytest.raises(ValueError, match=r"m2ops.mixer_fn: zxbcdt must be of last dimension"):
        mixer_fn(zx, m.conv1d.weight, m.conv1d.bias, m.dt_bias, m._A(), m.D, m.norm.weight, m.out_proj.weight, None,
                 chunk_size=8, headdim=SMALL["headdim"], ngroups=1)


def test_layer_default_is_mem_eff():
    assert m2ops.Mamba2(d_model=16, d_state=8, headdim=8).use_mem_eff_path is True
