"""What one public forward's host time is made of, launch by launch, on a GPU, as a script:

    python tests/gpu/launch_cost.py [--shapes 16K:64] [--chunk 256] [--n 200]

host_scan.py gives the host time of a whole call; cProfile cannot look inside cuTile's launch (a C function).
This script times the parts directly, each as the wall time of n repetitions queued behind a GPU sleep (so the
host never waits on the device), in microseconds per repetition:
- the public forward (no autograd), and each launcher the eager path calls (m2ops.kernels.launch);
- every ct.launch of that forward, replayed with the same grid, kernel and arguments: once through m2ops's
  _launch (stream handle, 32-bit twin, PDL flag) and once as the bare ct.launch;
- the fixed and per-argument cost of ct.launch on three trivial kernels (1 array; 10 arrays; 1 array and 10
  scalars), with and without programmatic dependent launch;
- torch.empty on the GPU, and torch's DLPack export (cuTile's route for a torch tensor argument).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import cuda.tile as ct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import index_width, launch  # noqa: E402
from m2ops.meta.validate import check_inputs  # noqa: E402
from m2ops.ops import eager  # noqa: E402


def host_us(fn, n, per_call_s=200e-6):
    """Wall time per call of fn over n calls issued while the GPU sleeps (median of 5 rounds); the sleep lasts
    per_call_s per call plus 2 ms, which must exceed the host's time."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        torch.cuda._sleep(int(2e9 * (n * per_call_s + 0.002)))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(out)[2]


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
    s = launch._stream_handle()
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
    rows["launch._stream_handle"] = launch._stream_handle
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16K:64")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    torch.cuda.init()
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), args.chunk)
        x = case["x"]
        with torch.no_grad():
            fwd = (lambda: public_call(case, return_final_states=True))
            fwd()
            recorded = []
            real = launch._launch
            launch._launch = lambda grid, kernel, kargs, *rest: (recorded.append((grid, kernel, kargs)),
                                                                 real(grid, kernel, kargs, *rest))[1]
            fwd()
            launch._launch = real
            torch.cuda.synchronize()
            print(f"{spec}: public forward {host_us(fwd, args.n // 10):8.1f} us host per call")
            # The same call through the launchers (v22's plan refused), alternating with the planned one.
            planned = launch.planned_forward
            for _ in range(2):
                launch.planned_forward = lambda *a, **k: None
                print(f"{spec}: public forward, launchers {host_us(fwd, args.n // 10):8.1f} us host per call")
                launch.planned_forward = planned
                print(f"{spec}: public forward, planned {host_us(fwd, args.n // 10):8.1f} us host per call")
        grads = {k: (v.detach().clone().requires_grad_() if k in ("x", "B", "C") else v) for k, v in case.items()}
        fwd_grad = (lambda: public_call(grads, return_final_states=True))
        print(f"{spec}: public forward, x/B/C requiring grad {host_us(fwd_grad, args.n // 10):8.1f} us host per call")
        with torch.no_grad():
            L = args.chunk
            c = case
            dt_out, cs = launch.chunk_cumsum(c["dt"], c["A"], None, L, True, 0.0, float("inf"))
            parts = {
                "launch.chunk_cumsum": lambda: launch.chunk_cumsum(c["dt"], c["A"], None, L, True, 0.0,
                                                                   float("inf")),
                "launch.chunk_scan": lambda: launch.chunk_scan(x, dt_out, cs, c["B"], c["C"],
                                                               c["initial_states"], c["D"], None, None,
                                                               keep_states=True),
                "launch.chunk_scan_configs": lambda: launch.chunk_scan_configs(1, x.shape[1], 80, 64, int(n_s),
                                                                               L, x.device),
                "launch._d_per_channel": lambda: launch._d_per_channel(c["D"], 80, 64, x),
                "check_inputs": lambda: check_inputs(x, c["dt"], c["A"], c["B"], c["C"], L, c["D"], None, None,
                                                     c["initial_states"], None, None, True, (0.0, float("inf")),
                                                     True, False),
                "eager.applies": lambda: eager.applies(x, c["dt"], c["A"], c["B"], c["C"], c["D"], None, None,
                                                       c["initial_states"], None),
            }
            for name, fn in parts.items():
                print(f"{spec}: {name:40s} {host_us(fn, args.n // 4):8.1f} us")
            for grid, kernel, kargs in recorded:
                name = kernel._pyfunc.__name__
                resolved = index_width.for_args(kernel, kargs)
                pdl = launch._pdl(kernel)
                s = launch._stream_handle()
                narr = sum(isinstance(a, torch.Tensor) for a in kargs)
                t_ours = host_us(lambda: launch._launch(grid, kernel, kargs), args.n)
                t_bare = host_us(lambda: ct.launch(s, grid, resolved, kargs, programmatic_dependent_launch=pdl),
                                 args.n)
                t_twin = host_us(lambda: index_width.for_args(kernel, kargs), args.n)
                print(f"{spec}: {name:28s} {narr:2d} arrays {len(kargs) - narr:2d} scalars: _launch {t_ours:6.1f}"
                      f"  bare ct.launch {t_bare:6.1f}  for_args {t_twin:5.1f} us")
        rows = trivial_rows(args.n)
        rows["torch.empty(y-sized) cuda"] = lambda: torch.empty(x.shape, dtype=x.dtype, device="cuda")
        for name, fn in rows.items():
            print(f"{name:40s} {host_us(fn, args.n):8.2f} us")


if __name__ == "__main__":
    main()
