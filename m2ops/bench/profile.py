"""python -m m2ops.bench.profile: a torch.profiler table of one m2ops.Mamba2 layer's forward (and backward).

Shows where the time goes by name: the layer's PyTorch parts (projections, conv, norm), the m2ops:: custom
ops and, on CUDA, the cuTile kernels they launch (chunk_cumsum_kernel, chunk_state_kernel, compute_out_kernel,
...). On a machine without a GPU the table has the CPU rows only (the ops then run the PyTorch reference).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m m2ops.bench.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--d-state", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backward", action="store_true", help="profile forward and backward")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    a = ap.parse_args(argv)
    from m2ops import Mamba2
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    layer = Mamba2(a.d_model, d_state=a.d_state, device=device, dtype=dtype)
    u = torch.randn(a.batch, a.seqlen, a.d_model, device=device, dtype=dtype, requires_grad=a.backward)

    def step():
        y = layer(u)
        if a.backward:
            y.float().square().mean().backward()
        return y

    for _ in range(2):  # compiles and tunes outside the profile
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"m2ops.Mamba2(d_model={a.d_model}, d_state={a.d_state}), {a.batch} x {a.seqlen} tokens, {a.dtype}, "
          f"{'forward + backward' if a.backward else 'forward'}, {device.type}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(prof.key_averages().table(sort_by=sort, row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
