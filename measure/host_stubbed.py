"""The host's cost of one public forward call with the kernel launches stubbed out, on the CPU, as a script:

    python measure/host_stubbed.py [--seqlen 64] [--dstate 64] [--backward] [--profile]

The public function takes its CUDA path (m2ops/ops/eager.py) on CPU tensors of the benchmark's other sizes
(B=1, H=80, P=64, G=1, bf16 x/B/C, float32 dt, D and initial states, chunk 256), with every launch replaced by a
no-op. What remains is m2ops's own Python, PyTorch's tensor creation and autograd: the part of the host time
(measure/host_scan.py) that does not depend on the GPU or on cuTile's launch. A short seqlen keeps the CPU's
allocations small. Each line gives microseconds per call (harness.wall_us); --profile adds cProfile's table by
own time. Needs cuTile installed (the launchers import it), not a GPU.
"""

from __future__ import annotations

import torch

import harness  # first of the local imports: it puts the repository on sys.path

import m2ops
from m2ops.kernels import forward, runtime, scan
from m2ops.ops import eager


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="cProfile's table of 200 public calls")
    ap.add_argument("--backward", action="store_true",
                    help="also the public call with gradients: forward + backward of every input (--profile: "
                         "its table)")
    args = ap.parse_args()
    runtime.launch = lambda grid, kernel, kargs, *_: None
    runtime.sm_count = lambda device: 132  # an H200's
    # the CUDA path on CPU tensors
    eager.applies = lambda serve, x, tensors: eager.context_allows(tensors)
    T, N, b, h, p, L = args.seqlen, args.dstate, 1, 80, 64, 256
    x = torch.randn(b, T, h, p, dtype=torch.bfloat16)
    B = torch.randn(b, T, 1, N, dtype=torch.bfloat16)
    C = torch.randn_like(B)
    dt, A, D, init = torch.rand(b, T, h), -torch.rand(h), torch.rand(h), torch.randn(b, h, p, N)
    dt_out, cs = forward.chunk_cumsum(dt, A, None, L, True, 0.0, float("inf"))
    states, _, _ = forward.fwd_pass_state(x, B, dt_out, cs, init, None, None, entering_dtype=torch.bfloat16)
    rows = {
        "public call": lambda: m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, L, D=D, initial_states=init,
                                                               return_final_states=True),
        "chunk_cumsum": lambda: forward.chunk_cumsum(dt, A, None, L, True, 0.0, float("inf")),
        "chunk_scan": lambda: scan.chunk_scan(x, dt_out, cs, B, C, init, D, None, None, keep_states=True),
        "  fwd_pass_state": lambda: forward.fwd_pass_state(x, B, dt_out, cs, init, None, None,
                                                          entering_dtype=torch.bfloat16),
        "  compute_out": lambda: forward.compute_out(x, dt_out, cs, C, B, states, D, None, None),
        "  chunk_scan_configs": lambda: scan.chunk_scan_configs(b, T, h, p, N, L, x.device),
    }
    if args.backward:
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C, D, init)]
        g_y = torch.randn_like(x)

        def train():
            xl, dtl, Al, Bl, Cl, Dl, il = leaves
            y, fin = m2ops.mamba_chunk_scan_combined(xl, dtl, Al, Bl, Cl, L, D=Dl, initial_states=il,
                                                     return_final_states=True)
            torch.autograd.backward((y, fin), (g_y, torch.ones_like(fin)))
        rows = {"public call, forward + backward": train, **rows}
    for name, fn in rows.items():
        print(f"{name:32s} {harness.wall_us(fn, 200 if name.startswith('public call') else 2000):8.1f} us")
    if args.profile:
        print(harness.cprofile(rows["public call, forward + backward" if args.backward else "public call"], 200, 30))


if __name__ == "__main__":
    main()
