"""Per-sequence start states (m2ops/sequence_states.py) on the kernels, on the emulator: the composition as it runs
on a GPU (chunk_cumsum, fwd_pass_state with cu_seqlens, compute_out and start_state_out launched; the entering and
final states' corrections in PyTorch) against the same composition on the reference ops, and against the float64
token loop; and start_state_out's kernel alone against its reference, over sequence layouts (sequences starting
at, inside and across chunk boundaries, one-token sequences, a sequence longer than a chunk), dtypes, z and
dstate/headdim past one tile.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow

import emulated_cases  # noqa: E402,F401  (puts tests/gpu on sys.path)
from gpu_cases import TOL, rel_err  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops import sequence_states  # noqa: E402
from m2ops.kernels import forward  # noqa: E402
from m2ops.meta.validate import seq_idx_from_cu_seqlens  # noqa: E402
from m2ops.reference.naive import naive_scan  # noqa: E402

LAUNCHERS = types.SimpleNamespace(chunk_cumsum=forward.chunk_cumsum, fwd_pass_state=forward.fwd_pass_state,
                                  compute_out=forward.compute_out, start_state_out=forward.start_state_out)


@pytest.mark.parametrize("dtype,chunk,cu", [(torch.bfloat16, 16, [0, 5, 21, 22, 40, 45]),
                                            (torch.float32, 32, [0, 32, 33, 70])])
def test_composition_on_kernels(dtype, chunk, cu, monkeypatch):
    T, h, p, g, n = cu[-1], 4, 16, 2, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, T, h, p, generator=gen).to(dtype)
    dt = torch.rand(1, T, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.2
    B = (torch.randn(1, T, g, n, generator=gen) * n ** -0.25).to(dtype)
    C = (torch.randn(1, T, g, n, generator=gen) * n ** -0.25).to(dtype)
    z = torch.randn(1, T, h, p, generator=gen).to(dtype)
    D = torch.randn(h, generator=gen)
    cu = torch.tensor(cu, dtype=torch.int32)
    starts = torch.randn(len(cu) - 1, h, p, n, generator=gen)
    seq_idx = seq_idx_from_cu_seqlens(cu, T)
    args = (x, dt, A, B, C, chunk, D, z, None, starts, seq_idx, cu, False, 0.0, float("inf"))
    y_ref, _, v_ref = sequence_states.scan(*args)
    monkeypatch.setattr(sequence_states, "ops", LAUNCHERS)
    with emulated_kernels():
        y, fin, v = sequence_states.scan(*args)
    assert y.dtype == dtype and v.dtype == torch.float32
    assert rel_err(y, y_ref) <= TOL["y"][dtype], rel_err(y, y_ref)
    assert rel_err(v, v_ref) <= TOL["states"][dtype], rel_err(v, v_ref)
    y64, _, v64 = naive_scan(x, dt, A, B, C, D=D, z=z, initial_states=starts, cu_seqlens=cu)
    assert rel_err(y, y64) <= TOL["y"][dtype] and rel_err(v, v64) <= TOL["states"][dtype]


@pytest.mark.parametrize("dtype,chunk,lens,h,g,p,n,z", [
    (torch.bfloat16, 16, [10, 3, 30, 1, 56], 4, 2, 24, 20, True),      # starts inside chunks, one-token sequences
    (torch.float32, 64, [70, 100, 1, 129], 2, 1, 64, 128, False),     # a window of one token, tiles filled
    (torch.float16, 64, [64, 66], 2, 1, 16, 200, True),               # a start on a chunk boundary, dstate > a tile
    (torch.bfloat16, 32, [5, 27, 32, 3], 2, 2, 80, 16, False),        # headdim past one tile
])
def test_start_state_out_kernel(dtype, chunk, lens, h, g, p, n, z):
    from m2ops.reference import start_states
    gen = torch.Generator().manual_seed(sum(lens))
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    y = torch.randn(1, T, h, p, generator=gen).to(dtype)
    C = torch.randn(1, T, g, n, generator=gen).to(dtype)
    zt = torch.randn(1, T, h, p, generator=gen).to(dtype) if z else None
    init = torch.randn(len(lens), h, p, n, generator=gen)
    cs = (-torch.rand(1, h, -(-T // chunk), chunk, generator=gen) * 0.1).cumsum(-1)
    want = start_states.start_state_out(y, C, zt, init, cs, cu)
    with emulated_kernels():
        got = forward.start_state_out(y, C, zt, init, cs, cu)
    assert got.dtype == dtype and got.shape == y.shape
    assert rel_err(got, want) <= TOL["y"][dtype], rel_err(got, want)
    assert torch.equal(got != y, want != y)  # the same tokens changed: the windows, nothing else
