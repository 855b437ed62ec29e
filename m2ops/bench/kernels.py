"""Where one peer's call spends its time, by kernel: the torch profiler's self time per call of each CUDA kernel
(on the CPU, of each operator), for `python -m m2ops.bench --kernels`. Names are shortened to the kernel's own
name (a cuTile symbol 'compute_out_kernel_Kt2_A4...' becomes 'compute_out_kernel') so that the same kernel
sums over its specialisations."""

from __future__ import annotations

import torch


def short_name(symbol: str) -> str:
    """A kernel's name without its specialisation suffix; other symbols cut at 80 characters."""
    cut = symbol.find("_kernel_")
    return symbol[:cut + len("_kernel")] if cut > 0 else symbol[:80]


def kernel_times(fn, device: torch.device, reps: int = 5, top: int = 12) -> dict:
    """ms per call of the `top` largest kernels (operators on the CPU) of fn, largest first, and the rest
    summed under "(others)". Runs fn once before profiling so that nothing is compiled or captured inside."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda != (ev.device_type == torch.autograd.DeviceType.CUDA):
            continue
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            name = short_name(ev.key)
            times[name] = times.get(name, 0.0) + us / 1000.0 / reps
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    out = {name: round(ms, 4) for name, ms in ranked[:top]}
    rest = sum(ms for _, ms in ranked[top:])
    if rest > 0:
        out["(others)"] = round(rest, 4)
    return out
