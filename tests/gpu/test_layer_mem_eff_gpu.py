"""m2ops.Mamba2's memory-efficient training path (use_mem_eff_path=True: m2ops::mixer, which recomputes the
convolution, the dt tensors and the norm in its backward) on CUDA, in bfloat16, against the plain path.

    python -m pytest -q -s -m gpu tests/gpu/test_layer_mem_eff_gpu.py

- Accuracy: the output and every gradient of both bfloat16 paths are compared with the plain path in float32 on
  the same GPU and the same (rounded) weights and input (normwise relative errors, gpu_cases.rel_err). The memory-
  efficient path must be as accurate as the plain one (at most 1.5x its error plus 5e-3; both are bfloat16
  approximations of the same float32 result that round at different places: the plain path's backward reuses the
  bfloat16 states entering each chunk, this one recomputes them in float32), and its output within BF16_TOL.
- Memory: four layers with residual connections (batch 2, 2048 tokens, d_model 1024, bfloat16). The memory held
  between forward and backward (the activations) must be below 0.7x the plain path's (expected per token and
  layer: 14.9 KB against 25.9 KB: u, zxbcdt and y against those plus the convolution's output, the bfloat16
  entering states, the dt tensors, the norm's output), and the peak of the whole step
  (torch.cuda.max_memory_allocated) below the plain path's. Both paths' step times are printed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import kernels_or_reason, rel_err  # noqa: E402

import m2ops  # noqa: E402

_kernels, _reason = kernels_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_kernels is None, reason=str(_reason))]

BF16 = torch.bfloat16
BF16_TOL = 2e-2
CUDA = "cuda"

# (constructor options); headdim 64, expand 2
CONFIGS = {
    "g2": dict(d_model=384, d_state=128, ngroups=2, chunk_size=128),
    "options": dict(d_model=256, d_state=64, ngroups=1, chunk_size=64, D_has_hdim=True, norm_before_gate=True,
                    bias=True, d_ssm=256),  # half of d_inner a gated MLP
}


def make_pair(opts, seed=0):
    """(bfloat16 layer, float32 layer with the same bfloat16-rounded weights), both on CUDA."""
    torch.manual_seed(seed)
    m32 = m2ops.Mamba2(**opts, headdim=64)
    with torch.no_grad():
        m32.D.normal_()
        m32.norm.weight.normal_(1.0, 0.3)
        m32.conv1d.bias.normal_(0.0, 0.3)
        m32.A_log.uniform_(-1.0, 1.5)
        m32.dt_bias.normal_(-1.5, 0.5)
    bf = m2ops.Mamba2(**opts, headdim=64, device=CUDA, dtype=BF16)
    bf.load_state_dict(m32.state_dict())
    ref = m2ops.Mamba2(**opts, headdim=64, device=CUDA)
    ref.load_state_dict({k: v.float() for k, v in bf.state_dict().items()})
    return bf, ref


def step(layer, u, g_out, mem_eff, **kwargs):
    """{output, gradient of u, of every parameter} of one training step."""
    layer.use_mem_eff_path = mem_eff
    layer.zero_grad(set_to_none=True)
    x = u.clone().requires_grad_(True)
    y = layer(x, **kwargs)
    y.backward(g_out.to(y.dtype))
    out = {"output": y.detach(), "grad of u": x.grad}
    out.update({f"grad of {k}": p.grad for k, p in layer.named_parameters()})
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("packed", [False, True])
def test_mem_eff_as_accurate_as_plain(name, packed):
    bf, ref = make_pair(CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    b, T = 2, 333  # not a multiple of any chunk size
    u = torch.randn(b, T, bf.d_model, generator=g).to(BF16).to(CUDA)
    g_out = torch.randn(b, T, bf.d_model, generator=g).to(BF16).to(CUDA)
    kwargs = {}
    if packed:
        kwargs["seq_idx"] = torch.tensor([[0] * 100 + [1] * 233, [0] * 300 + [1] * 33], dtype=torch.int32,
                                         device=CUDA)
    want = step(ref, u.float(), g_out.float(), False, **kwargs)
    plain = step(bf, u, g_out, False, **kwargs)
    mem = step(bf, u, g_out, True, **kwargs)
    torch.cuda.synchronize()
    for k, w in want.items():
        assert mem[k] is not None and mem[k].dtype == plain[k].dtype, k
        err_mem, err_plain = rel_err(mem[k].float(), w), rel_err(plain[k].float(), w)
        assert err_mem <= 1.5 * err_plain + 5e-3, \
            f"{k}: memory-efficient {err_mem:.3e} from float32, plain {err_plain:.3e}"
    assert rel_err(mem["output"].float(), want["output"]) <= BF16_TOL


class Stack(torch.nn.Module):
    def __init__(self, n, **kw):
        super().__init__()
        self.layers = torch.nn.ModuleList(m2ops.Mamba2(**kw) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def measure(model, u, g_out, mem_eff):
    """(MiB held between forward and backward beyond the output, peak MiB of the step above what was allocated
    before it, step ms: median of 5 after 2 warm-up steps)."""
    for layer in model.layers:
        layer.use_mem_eff_path = mem_eff
    times = []
    for i in range(7):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(u)
        held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        out.backward(g_out)
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        if i >= 2:
            times.append(start.elapsed_time(end))
    return held / 2 ** 20, peak / 2 ** 20, sorted(times)[len(times) // 2]


def test_mem_eff_keeps_less_memory():
    torch.manual_seed(0)
    model = Stack(4, d_model=1024, d_state=128, headdim=64, chunk_size=256, device=CUDA, dtype=BF16)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 2048, 1024, generator=g).to(BF16).to(CUDA)
    g_out = torch.randn(2, 2048, 1024, generator=g).to(BF16).to(CUDA)
    plain = measure(model, u, g_out, False)
    mem = measure(model, u, g_out, True)
    print(f"\nplain: held {plain[0]:.1f} MiB, peak {plain[1]:.1f} MiB, step {plain[2]:.3f} ms"
          f"\nmem-eff: held {mem[0]:.1f} MiB, peak {mem[1]:.1f} MiB, step {mem[2]:.3f} ms")
    assert mem[0] < 0.7 * plain[0], (mem, plain)
    assert mem[1] < plain[1], (mem, plain)
