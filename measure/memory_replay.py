"""The peak memory of one training step of m2ops.Mamba2 (or of the scan alone), without a GPU: the CUDA route's
allocations replayed on the CPU with nothing computed.

    python measure/memory_replay.py [--mode layer|scan] [--shape 8x4096] [--d-model 2560] [--dstate 128]
                                    [--top 20] [--json OUT]

Every m2ops op runs its CUDA implementation (the launchers, as on a GPU; dispatch says the kernels serve) on CPU
tensors, with each kernel launch a no-op. Under a dispatch mode every other PyTorch operation is only shaped: its
outputs are allocated (with the strides the real operation gives, from its meta implementation) and left
unwritten; views, in-place operations and factories run as they are. Each storage created during the step is
followed (torch's StorageWeakRef) from the operation that made it, with the innermost m2ops frames, until it is
freed. Prints the peak of the live bytes above what was alive before the step (what measure/layer_memory.py
reports from CUDA's allocation history on a GPU) and the storages alive there, largest first.

What this does not see: the CUDA caching allocator's rounding (512 B) and block splitting, cuBLAS workspaces and
cuTile's own scratch. The step is the layer bench's: bf16, headdim 64, one group, a gradient for the input and
every parameter (mode layer: d_model, expand 2, the memory-efficient path; mode scan: the public function on
B=batch, H=80, P=64, with D and an initial state, as the bench's forward+backward).
"""

from __future__ import annotations

import traceback

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import m2ops
from m2ops import ops
from m2ops.kernels import runtime
from m2ops.ops import dispatch, eager


def route_ops_to_launchers():
    """Every m2ops op with a CUDA implementation runs it on CPU tensors too, the kernels serving; launches do
    nothing."""
    runtime.launch = lambda grid, kernel, kargs, *_: None
    runtime.sm_count = lambda device: 132  # an H200's
    dispatch._kernels_serve = lambda device_type, device_index: True
    eager.applies = lambda serve, x, tensors: eager.context_allows(tensors)
    impls = {}
    for name in ops.__all__:
        op = getattr(ops, name)
        fn = getattr(op, "_backend_fns", {}).get("cuda")
        if fn is not None:
            op.register_kernel("cpu")(fn)
            impls[op._qualname] = fn
        else:
            impls[op._qualname] = op._init_fn
    return impls


def _site(frames=3):
    own = [f"{f.filename.split('m2ops/', 1)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
           if "/m2ops/" in f.filename and "/measure/" not in f.filename]
    return " <- ".join(reversed(own[-frames:])) or "(autograd / caller)"


class ShapeOnly(TorchDispatchMode):
    """Shapes what it can, runs m2ops ops' implementations under itself, follows every new storage."""

    def __init__(self, impls):
        super().__init__()
        self.impls, self.live, self.peak, self.at_peak = impls, {}, 0, {}

    def _follow(self, out, func):
        for t in (o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)):
            st = t.untyped_storage()
            key = st.data_ptr()
            if st.nbytes() == 0 or (key in self.live and not self.live[key][0].expired()):
                continue
            self.live[key] = (StorageWeakRef(st), st.nbytes(), f"{func.__name__}  {_site()}")
        for key in [k for k, v in self.live.items() if v[0].expired()]:
            del self.live[key]
        total = sum(v[1] for v in self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, {k: v[1:] for k, v in self.live.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        qual = func.namespace + "::" + func._schema.name.split("::")[-1]
        if func.namespace == "m2ops":
            with self:
                return self.impls[qual](*args, **kwargs)  # (its own operations are followed)
        if (func._schema.is_mutable or any(r.alias_info is not None for r in func._schema.returns)
                or func.__name__ in _VIEWS_UNANNOTATED or func.namespace == "prim"):
            return func(*args, **kwargs)  # in place or a view: no new storage
        if not any(isinstance(a, torch.Tensor) for a in args):
            out = func(*args, **kwargs)  # a factory
        else:
            try:
                meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            except Exception:  # noqa: BLE001 - no meta implementation: run it
                out = func(*args, **kwargs)
            else:
                out = tree_map(_alloc_like, meta)
        self._follow(out, func)
        return out


# views whose schemas do not say so
_VIEWS_UNANNOTATED = ("_unsafe_view.default", "lift_fresh.default")


def _to_meta(a):
    return a.to("meta") if isinstance(a, torch.Tensor) and a.device.type != "meta" else a


def _alloc_like(m):
    if isinstance(m, torch.Tensor):
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")
    return m


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--mode", choices=("layer", "scan"), default="layer")
    ap.add_argument("--shape", default="8x4096")
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--top", type=int, default=20)
    harness.add_json(ap)
    args = ap.parse_args()
    b, t = (int(v) for v in args.shape.lower().split("x"))
    impls = route_ops_to_launchers()
    torch.manual_seed(0)
    bf = torch.bfloat16
    if args.mode == "layer":
        layer = m2ops.Mamba2(d_model=args.d_model, d_state=args.dstate, d_conv=4, expand=2, headdim=64, ngroups=1,
                             rmsnorm=True, norm_before_gate=False, dtype=bf)
        u = torch.zeros(b, t, args.d_model, dtype=bf, requires_grad=True)
        g = torch.zeros_like(u)
        leaves = [u, *layer.parameters()]

        def step():
            return torch.autograd.grad(layer(u), leaves, g)
    else:
        h, p, n = 80, 64, args.dstate
        x = torch.zeros(b, t, h, p, dtype=bf, requires_grad=True)
        B = torch.zeros(b, t, 1, n, dtype=bf, requires_grad=True)
        C = torch.zeros(b, t, 1, n, dtype=bf, requires_grad=True)
        dt = torch.zeros(b, t, h, requires_grad=True)
        A, D = torch.full((h,), -1.0, requires_grad=True), torch.ones(h, requires_grad=True)
        init = torch.zeros(b, h, p, n, requires_grad=True)
        leaves = [x, dt, A, B, C, D, init]
        g_y = torch.zeros(b, t, h, p, dtype=bf)

        def step():
            y, fin = m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, initial_states=init,
                                                     return_final_states=True)
            return torch.autograd.grad((y, fin), leaves, (g_y, torch.zeros_like(fin)))
    mode = ShapeOnly(impls)
    with mode:
        grads = step()
    del grads
    what = f"d_model {args.d_model}" if args.mode == "layer" else "H=80, P=64"
    print(f"{args.mode} {args.shape}, {what}, dstate {args.dstate}: peak above the step's start "
          f"{mode.peak / 2 ** 20:.0f} MiB (storages made during the step, alive together)")
    rows = sorted(({"mib": nbytes / 2 ** 20, "site": site} for nbytes, site in mode.at_peak.values()),
                  key=lambda r: -r["mib"])
    for r in rows[:args.top]:
        print(f"  {r['mib']:9.1f} MiB  {r['site']}")
    harness.write_json(args.json, rows, peak_mib=mode.peak / 2 ** 20, mode=args.mode, shape=args.shape)


if __name__ == "__main__":
    main()
