"""python -m m2ops: the main job. A Mamba-2 SSD workload through torch.compile on the best device present,
timed, and checked against the token-by-token float64 recurrence."""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from . import mamba_chunk_scan_combined
from .ops import dispatch
from .reference.naive import naive_scan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative error (max |y - y_naive| / max |y_naive|) allowed per input dtype: inputs are rounded to the
# dtype before both runs, so what remains is accumulation order and the output's rounding.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m m2ops", description=__doc__)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=1000, help="tokens per row (need not divide by chunk size)")
    p.add_argument("--nheads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dstate", type=int, default=64)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--sequences", type=int, default=1,
                   help="pack this many sequences per row (seq_idx); 1 for plain rows")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after the warm-up")
    p.add_argument("--no-compile", action="store_true", help="run eagerly instead of torch.compile")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_inputs(a, device, dtype):
    """A Mamba-2 layer's scan inputs: softplus(dt + dt_bias), A < 0, D per head, z gate, initial state."""
    g = torch.Generator().manual_seed(a.seed)
    b, T, h, p, G, n = a.batch, a.seqlen, a.nheads, a.headdim, a.ngroups, a.dstate

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    inputs = dict(
        x=randn(b, T, h, p).to(dtype), dt=randn(b, T, h, scale=0.5), A=-torch.rand(h, generator=g).add(0.5).to(device),
        B=randn(b, T, G, n, scale=n ** -0.5).to(dtype), C=randn(b, T, G, n, scale=n ** -0.5).to(dtype),
        D=randn(h), z=randn(b, T, h, p).to(dtype), dt_bias=randn(h, scale=0.5) - 2.0,
        initial_states=randn(b, h, p, n, scale=0.1), dt_softplus=True)
    if a.sequences > 1:
        cuts = torch.randperm(T - 1, generator=g)[: a.sequences - 1].add(1).sort().values
        seq = torch.zeros(T, dtype=torch.int32)
        seq[cuts] = 1
        inputs["seq_idx"] = seq.cumsum(0, dtype=torch.int32).expand(b, T).contiguous().to(device)
    return inputs


def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv=None):
    a = parse_args(argv)
    if a.nheads % a.ngroups:
        sys.exit(f"--ngroups ({a.ngroups}) must divide --nheads ({a.nheads})")
    device = pick_device(a.device)
    dtype = DTYPES[a.dtype] if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = "cuTile kernels" if device.type == "cuda" and dispatch.use_kernels(device) else "PyTorch reference"
    inputs = make_inputs(a, device, dtype)

    def scan(inputs):
        return mamba_chunk_scan_combined(chunk_size=a.chunk_size, return_final_states=True, **inputs)

    fn = scan if a.no_compile else torch.compile(scan, fullgraph=True)
    print(f"m2ops {device} ({backend}), {'eager' if a.no_compile else 'torch.compile(fullgraph=True)'}: "
          f"batch={a.batch} seqlen={a.seqlen} nheads={a.nheads} headdim={a.headdim} dstate={a.dstate} "
          f"ngroups={a.ngroups} chunk={a.chunk_size} {str(dtype).replace('torch.', '')} sequences={a.sequences}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    y, final = fn(inputs)
    sync()
    print(f"first call (compile + run): {time.perf_counter() - t0:.2f} s")
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        fn(inputs)
        sync()
        times.append(time.perf_counter() - t0)
    if times:
        times.sort()
        ms = 1e3 * times[len(times) // 2]
        tokens = a.batch * a.seqlen / (ms / 1e3)
        rate = f"{tokens / 1e6:.2f} M" if tokens >= 1e6 else f"{tokens / 1e3:.1f} K"
        print(f"median of {a.repeats} calls: {ms:.3f} ms ({rate} tokens/s)")

    y_ref, final_ref, _ = naive_scan(**{k: v for k, v in inputs.items()})
    err = ((y.double().cpu() - y_ref).abs().max() / y_ref.abs().max()).item()
    err_state = ((final.double().cpu() - final_ref).abs().max() / final_ref.abs().max()).item()
    tol = TOLERANCE[dtype]
    ok = err <= tol and err_state <= tol and math.isfinite(err) and math.isfinite(err_state)
    print(f"vs token-by-token float64 recurrence: output rel. error {err:.2e}, final state {err_state:.2e} "
          f"(tolerance {tol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
