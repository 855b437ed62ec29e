"""The host's cost of one public forward call with the kernel launches stubbed out, on the CPU, as a script:

    python measure/host_stubbed.py [--seqlen 64] [--dstate 64] [--heads 80] [--headdim 64] [--chunk 256]
                                   [--backward] [--profile] [--ops]

The public function takes its CUDA path (m2ops/ops/eager.py) on CPU tensors of the benchmark's other sizes
(B=1, H=80, P=64, G=1, bf16 x/B/C, float32 dt, D and initial states, chunk 256), with every launch replaced by a
no-op. What remains is m2ops's own Python, PyTorch's tensor creation and autograd: the part of the host time
(measure/host_scan.py) that does not depend on the GPU or on cuTile's launch. A short seqlen keeps the CPU's
allocations small; small --heads, --headdim and --chunk (e.g. 4, 16, 16) leave the CPU next to no arithmetic in
PyTorch's operators, so that what is timed is their dispatch. Each line gives microseconds per call
(harness.wall_us); --profile adds cProfile's table by own time; --ops lists, for forward + backward, the PyTorch
operators that would each launch a CUDA kernel (not views or allocations) by the m2ops line that calls them, and
counts the cuTile launches. Needs cuTile installed (the launchers import it), not a GPU.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import harness  # first of the local imports: it puts the repository on sys.path

import m2ops
from m2ops.kernels import forward, runtime, scan
from m2ops.ops import eager


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=64)
    ap.add_argument("--heads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="cProfile's table of 200 public calls")
    ap.add_argument("--ops", action="store_true", help="the operators and launches of one forward + backward")
    ap.add_argument("--backward", action="store_true",
                    help="also the public call with gradients: forward + backward of every input (--profile: "
                         "its table)")
    args = ap.parse_args()
    launches = []
    runtime.launch = lambda grid, kernel, kargs, *_: launches.append(kernel)
    runtime.sm_count = lambda device: 132  # an H200's
    # the CUDA path on CPU tensors
    eager.applies = lambda serve, x, tensors: eager.context_allows(tensors)
    T, N, b, h, p, L = args.seqlen, args.dstate, 1, args.heads, args.headdim, args.chunk
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
    if args.backward or args.ops:
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C, D, init)]
        g_y = torch.randn_like(x)

        def train():
            xl, dtl, Al, Bl, Cl, Dl, il = leaves
            y, fin = m2ops.mamba_chunk_scan_combined(xl, dtl, Al, Bl, Cl, L, D=Dl, initial_states=il,
                                                     return_final_states=True)
            torch.autograd.backward((y, fin), (g_y, torch.ones_like(fin)))
        rows = {"public call, forward + backward": train, **rows}
    if args.ops:
        from memory_replay import route_ops_to_launchers  # under a dispatch mode the public call takes the ops
        impls = route_ops_to_launchers()
        runtime.launch = lambda grid, kernel, kargs, *_: launches.append(kernel)
        launches.clear()
        with LaunchingOps(impls) as mode:
            rows["public call, forward + backward"]()
        for (op, site), n in collections.Counter(mode.ops).most_common():
            print(f"{n:3d}  {op:28s} {site}")
        print(f"{len(mode.ops)} operators that launch a kernel, {len(launches)} cuTile launches")
        return
    for name, fn in rows.items():
        print(f"{name:32s} {harness.wall_us(fn, 200 if name.startswith('public call') else 2000):8.1f} us")
    if args.profile:
        print(harness.cprofile(rows["public call, forward + backward" if args.backward else "public call"], 200, 30))


class LaunchingOps(TorchDispatchMode):
    """Records each PyTorch operator that would launch a kernel on a GPU (not a view, an allocation or a custom
    op, whose own operators it records instead) with the innermost m2ops line that called it."""

    _QUIET = ("empty.memory_format", "empty_strided.default", "promote_types.default", "detach.default",
              "_unsafe_view.default", "lift_fresh.default", "new_empty.default")

    def __init__(self, impls):
        super().__init__()
        self.impls, self.ops = impls, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "m2ops":
            with self:
                return self.impls[f"m2ops::{func._schema.name.split('::')[-1]}"](*args, **kwargs)
        view = not func._schema.is_mutable and any(r.alias_info is not None for r in func._schema.returns)
        if not view and func.__name__ not in self._QUIET:
            own = [f for f in traceback.extract_stack() if "/m2ops/" in f.filename]
            site = f"{own[-1].filename.split('m2ops/')[-1]}:{own[-1].lineno} {own[-1].name}" if own else "(autograd)"
            self.ops.append((func.__name__, site))
        return func(*args, **kwargs)


if __name__ == "__main__":
    main()
