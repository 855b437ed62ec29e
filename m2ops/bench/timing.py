"""Timing by the protocol: CUDA events, L2 flushed before each run, warm-up excluded, median of many runs."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, runs: int = 100, warmup: int = 10, device=None) -> float:
    if device is None or torch.device(device).type != "cuda":
        return _median_ms_host(fn, runs, warmup)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.empty(max(2 * l2, 1 << 26), dtype=torch.uint8, device=device)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        flush.zero_()  # evict the inputs: every run reads them from HBM
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _median_ms_host(fn, runs, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def runs_ms(fn, device, runs: int, warmup: int) -> list:
    """Per-run times in ms of fn() after warm-up runs: CUDA events with a synchronisation before and after each
    run (whole calls, caches as the previous run left them: what a model or layer step costs), perf_counter on the
    CPU."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def graphed(fn):
    """Capture fn in a CUDA graph (after a warm-up on a side stream: kernels compiled, allocator warmed outside the
    capture) and return its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def summary(times) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs_ms": times}
