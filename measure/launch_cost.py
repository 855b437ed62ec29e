"""What one public forward's host time is made of, launch by launch, on a GPU, as a script:

    python measure/launch_cost.py [--shapes 16K:64] [--chunk 256] [--n 200]

host_scan.py gives the host time of a whole call; cProfile cannot look inside cuTile's launch (a C function).
This script times the parts directly, each as the wall time of n repetitions queued behind a GPU sleep (so the
host never waits on the device; harness.host_us), in microseconds per repetition:
- the public forward (no autograd), and each launcher the eager path calls (m2ops.kernels.forward and .scan);
- every ct.launch of that forward, replayed with the same grid, kernel and arguments: once through m2ops's
  runtime.launch (stream handle, 32-bit twin, PDL flag) and once as the bare ct.launch;
- the fixed and per-argument cost of ct.launch on three trivial kernels (1 array; 10 arrays; 1 array and 10
  scalars), with and without programmatic dependent launch;
- torch.empty on the GPU, and torch's DLPack export (cuTile's route for a torch tensor argument).
"""

from __future__ import annotations

import torch

import cuda.tile as ct

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case
from harness import host_us

from m2ops.kernels import forward, index_width, planned, runtime, scan
from m2ops.meta.validate import check_inputs
from m2ops.ops import dispatch, eager


@ct.kernel
def _one_array(a0: ct.Array, s0: int):
    t = ct.load(a0, index=(0,), shape=(16,))
    ct.store(a0, index=(0,), tile=t)


@ct.kernel
def _ten_arrays(a0: ct.Array, a1: ct.Array, a2: ct.Array, a3: ct.Array, a4: ct.Array, a5: ct.Array,
                a6: ct.Array, a7: ct.Array, a8: ct.Array, a9: ct.Array, s0: int):
    t = ct.load(a0, index=(0,), shape=(16,))
    ct.store(a0, index=(0,), tile=t)


@ct.kernel
def _ten_scalars(a0: ct.Array, s0: int, s1: int, s2: int, s3: int, s4: int, s5: int, s6: int, s7: int, s8: int,
                 s9: int):
    t = ct.load(a0, index=(0,), shape=(16,))
    ct.store(a0, index=(0,), tile=t)


def trivial_rows(n):
    a = [torch.zeros(1024, device="cuda") for _ in range(10)]
    s = runtime.stream_handle()
    rows = {}
    for pdl in (False, True):
        tag = " pdl" if pdl else ""
        rows[f"ct.launch 1 array + 1 int{tag}"] = lambda pdl=pdl: ct.launch(
            s, (1, 1, 1), _one_array, (a[0], 3), programmatic_dependent_launch=pdl)
        rows[f"ct.launch 10 arrays + 1 int{tag}"] = lambda pdl=pdl: ct.launch(
            s, (1, 1, 1), _ten_arrays, (*a, 3), programmatic_dependent_launch=pdl)
        rows[f"ct.launch 1 array + 10 ints{tag}"] = lambda pdl=pdl: ct.launch(
            s, (1, 1, 1), _ten_scalars, (a[0], *range(10)), programmatic_dependent_launch=pdl)
    rows["torch.empty((1,)) cuda"] = lambda: torch.empty((1,), device="cuda")
    rows["torch.empty(y-sized) cuda"] = None  # filled by the caller
    rows["torch._C._to_dlpack"] = lambda: torch._C._to_dlpack(a[0])
    rows["runtime.stream_handle"] = runtime.stream_handle
    return rows


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:64")
    harness.add_chunk(ap)
    ap.add_argument("--n", type=int, default=200, help="calls per timing round (launchers: n/4, public calls: n/10)")
    args = ap.parse_args()
    torch.cuda.init()
    for T, N, spec in args.shapes:
        case = scan_case(T, N, args.chunk)
        x = case["x"]
        with torch.no_grad():
            fwd = (lambda: public_call(case, return_final_states=True))
            fwd()
            recorded = []
            real = runtime.launch
            runtime.launch = lambda grid, kernel, kargs, *rest: (recorded.append((grid, kernel, kargs)),
                                                                 real(grid, kernel, kargs, *rest))[1]
            fwd()
            runtime.launch = real
            torch.cuda.synchronize()
            print(f"{spec}: public forward {host_us(fwd, args.n // 10):8.1f} us host per call")
            # The same call through the launchers (v22's plan refused, and the plan kept for the call's key
            # declined), alternating with the planned one.
            real_planned, real_remembered = planned.planned_forward, eager.remembered_call
            for _ in range(2):
                planned.planned_forward = lambda *a, **k: None
                eager.remembered_call = lambda *a, **k: None
                try:
                    print(f"{spec}: public forward, launchers {host_us(fwd, args.n // 10):8.1f} us host per call")
                finally:
                    planned.planned_forward, eager.remembered_call = real_planned, real_remembered
                print(f"{spec}: public forward, planned {host_us(fwd, args.n // 10):8.1f} us host per call")
        grads = {k: (v.detach().clone().requires_grad_() if k in ("x", "B", "C") else v) for k, v in case.items()}
        fwd_grad = (lambda: public_call(grads, return_final_states=True))
        print(f"{spec}: public forward, x/B/C requiring grad {host_us(fwd_grad, args.n // 10):8.1f} us host per call")
        with torch.no_grad():
            L = args.chunk
            c = case
            dt_out, cs = forward.chunk_cumsum(c["dt"], c["A"], None, L, True, 0.0, float("inf"))
            parts = {
                "forward.chunk_cumsum": lambda: forward.chunk_cumsum(c["dt"], c["A"], None, L, True, 0.0,
                                                                   float("inf")),
                "scan.chunk_scan": lambda: scan.chunk_scan(x, dt_out, cs, c["B"], c["C"],
                                                               c["initial_states"], c["D"], None, None,
                                                               keep_states=True),
                "scan.chunk_scan_configs": lambda: scan.chunk_scan_configs(1, x.shape[1], 80, 64, N,
                                                                               L, x.device),
                "runtime.d_per_channel": lambda: runtime.d_per_channel(c["D"], 80, 64, x),
                "check_inputs": lambda: check_inputs(x, c["dt"], c["A"], c["B"], c["C"], L, c["D"], None, None,
                                                     c["initial_states"], None, None, True, (0.0, float("inf")),
                                                     True, False),
                "the decision and path": lambda: eager.applies(
                    dispatch.kernels_serve(x.device, L, (x, c["dt"], c["B"], c["C"], None)), x,
                    (x, c["dt"], c["B"], c["C"], None, c["A"], c["D"], None, c["initial_states"], None)),
            }
            for name, fn in parts.items():
                print(f"{spec}: {name:40s} {host_us(fn, args.n // 4):8.1f} us")
            for grid, kernel, kargs in recorded:
                name = kernel._pyfunc.__name__
                resolved = index_width.for_args(kernel, kargs)
                pdl = runtime.uses_pdl(kernel)
                s = runtime.stream_handle()
                narr = sum(isinstance(a, torch.Tensor) for a in kargs)
                t_ours = host_us(lambda: runtime.launch(grid, kernel, kargs), args.n)
                t_bare = host_us(lambda: ct.launch(s, grid, resolved, kargs, programmatic_dependent_launch=pdl),
                                 args.n)
                t_twin = host_us(lambda: index_width.for_args(kernel, kargs), args.n)
                print(f"{spec}: {name:28s} {narr:2d} arrays {len(kargs) - narr:2d} scalars: runtime.launch {t_ours:6.1f}"
                      f"  bare ct.launch {t_bare:6.1f}  for_args {t_twin:5.1f} us")
        rows = trivial_rows(args.n)
        rows["torch.empty(y-sized) cuda"] = lambda: torch.empty(x.shape, dtype=x.dtype, device="cuda")
        for name, fn in rows.items():
            print(f"{name:40s} {host_us(fn, args.n):8.2f} us")


if __name__ == "__main__":
    main()
