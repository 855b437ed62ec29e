"""m2ops::mixer and its backward (m2ops/ops/mixer.py, the layer's use_mem_eff_path) through the kernels on the
emulator: every op the composition calls replaced by its launcher (what the op's CUDA implementation calls where
the kernels serve), so the launchers get the tensors the composition hands them on a GPU (slices of in_proj's
output, the convolution's channel-last output and its gradient, the norm's gradient, the recomputed dt tensors);
the layer's output and every gradient against the same layer on the reference.

The kernels' own code on the CPU through tests/tile_emulator.py (tests/emulated_cases.py says what that catches).
Tolerances: the GPU tests' for y (tests/gpu/gpu_cases.py TOL) on the output and the gradients; the gradients of
dt_bias and A_log are sums over every token whose terms cancel, computed from tf32 or bfloat16 products: 5e-2 (a
wrong index or mask gives errors of order 1).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # outside the quick subset (-m "not slow")

from emulated_cases import TOL, rel_err  # noqa: E402  (puts tests/gpu on sys.path)
from tile_emulator import emulated_kernels  # noqa: E402

import m2ops  # noqa: E402
from m2ops import kernels  # noqa: E402

# (the module: m2ops.ops.mixer is the op, which shadows its module as an attribute of m2ops.ops)
mixer_module = importlib.import_module("m2ops.ops.mixer")
OPS = ("causal_conv1d", "causal_conv1d_bwd", "chunk_cumsum", "chunk_cumsum_bwd", "chunk_scan", "rms_norm_gated",
       "rms_norm_gated_bwd")
SCAN_BWD_OPS = ("fwd_pass_state", "compute_out_bwd", "state_passing_bwd", "chunk_state_bwd")
SUM_TOL = 5e-2


def layer_step(opts, dtype, seq_idx=None):
    """(output, gradient of u, of every parameter) of one training step of a small layer."""
    torch.manual_seed(0)
    m = m2ops.Mamba2(**opts).to(dtype)
    with torch.no_grad():
        m.D.normal_()
        m.norm.weight.normal_(1.0, 0.3)
        m.conv1d.bias.normal_(0.0, 0.3)
        m.A_log.uniform_(-1.0, 0.7)
        m.dt_bias.normal_(-1.0, 0.5)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 100, opts["d_model"], generator=g).to(dtype).requires_grad_(True)
    out = m(u, seq_idx=seq_idx)
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    return out.detach(), {"u": u.grad, **{k: p.grad for k, p in m.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [
    dict(d_model=32, d_state=32, headdim=16, ngroups=2, chunk_size=64),
    dict(d_model=32, d_state=32, headdim=16, ngroups=1, chunk_size=64, d_ssm=32, norm_before_gate=True, bias=True),
], ids=["groups", "mlp_part"])
def test_mixer_on_kernels_matches_reference(opts, dtype, monkeypatch):
    seq_idx = torch.tensor([[0] * 40 + [1] * 60, [0] * 100])
    want_out, want = layer_step(opts, dtype, seq_idx)
    for name in OPS:
        monkeypatch.setattr(mixer_module, name, getattr(kernels, name))
    for name in SCAN_BWD_OPS:
        monkeypatch.setattr(mixer_module.RegisteredOps, name, staticmethod(getattr(kernels, name)))
    with emulated_kernels():
        got_out, got = layer_step(opts, dtype, seq_idx)
    tol = TOL["y"][dtype]
    assert rel_err(got_out, want_out) <= tol
    for k, w in want.items():
        err = rel_err(got[k], w)
        assert err <= (SUM_TOL if k in ("dt_bias", "A_log") else tol), f"{k}: {err:.3e}"
