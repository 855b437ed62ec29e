"""Where the host's time goes in one public call, on a GPU, as a script:

    python tests/gpu/host_scan.py [--shapes 4K:128,1K:128] [--chunk 256] [--rows 30] [--spin SECONDS]

A call is host-bound when the Python that issues its kernels takes longer than the kernels themselves (the
eager forward at T <= 4K, forward + backward at T <= 16K on an H200). For each shape (as backward_scan.py: B=1,
H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states) this prints the host time per call of the
forward and of forward + backward (the wall time of issuing a few calls while the GPU sleeps, against the
device time of the same calls run back to back afterwards), then cProfile's functions by own time over 20 calls
of forward + backward: cuTile's launch, PyTorch's operators and the custom-op machinery each appear under their
own names (cProfile inflates Python-heavy frames, and torch's dynamo-disable wrapper confuses its attribution).
--spin S then calls forward + backward for S seconds more, for a sampling profiler outside the process:
    py-spy record -r 500 -f raw -o OUT/spy.txt -- python tests/gpu/host_scan.py --shapes 4K:128 --spin 15
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import forward_and_backward, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402


def host_and_device_us(fn, n=5, reps=7):
    """(host us, device us) per call of fn, medians over reps rounds of n calls. Each round first queues a GPU
    sleep longer than the host needs to issue the n calls, so the host's issue time (wall time of the n calls)
    and the device's time (CUDA events around the n calls, which then run back to back) are measured apart."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    rough = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, dev = [], []
    for _ in range(reps):
        torch.cuda._sleep(int(2e9 * (2 * n * rough + 0.002)))  # cycles, at about 2 GHz
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) / n * 1e6)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end) / n * 1e3)
    return sorted(host)[reps // 2], sorted(dev)[reps // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4K:128,1K:128")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--spin", type=float, default=0.0, help="seconds of forward+backward calls at the end")
    args = ap.parse_args()
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        forward, both = forward_and_backward(scan_case(parse_sizes(t_s)[0], int(n_s), args.chunk))

        for name, fn in (("forward", forward), ("forward+backward", both)):
            host, dev = host_and_device_us(fn)
            print(f"{spec} {name}: host {host:.0f} us per call, device {dev:.0f} us per call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            both()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.rows)
        print(f"{spec} forward+backward, 20 calls under cProfile, by own time:")
        print(out.getvalue())
        t_end = time.perf_counter() + args.spin
        while time.perf_counter() < t_end:
            both()


if __name__ == "__main__":
    main()
