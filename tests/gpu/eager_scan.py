"""Why an eager call can take longer than its kernels, as a script (the 4K/N=512 question of docs/benchmarks.md,
thirteenth session):

    python tests/gpu/eager_scan.py [--shapes 4K:512,4K:64] [--blocks default,512,4096] [--json OUT]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D and initial states, chunk 256) and each
state_passing block (launch.STATE_BLOCK_OVERRIDE; "default" is the launcher's own choice; tuning is off), in one
process, it reports:
- eager_ms: the public call timed by the benchmark's protocol (m2ops.bench.timing.median_ms: L2 flushed before
  each run, runs queued back to back, CUDA events, median of 100);
- graph_ms: the same call replayed from a CUDA graph, same protocol;
- host_us: the host's time per call, issued while the GPU sleeps, so that the host never waits on the device;
- alloc: what the caching allocator did during the 100 eager runs (torch.cuda.memory_stats deltas: device
  mallocs and frees, allocation retries, synchronisations of all streams). Any nonzero count there means the
  eager call paid for cudaMalloc / cudaFree, which the graph never does;
- kernels: each kernel's device time in eager calls (torch profiler), to set against the graph's.
Then the eager timing again with the runs in the opposite order of blocks, since the first shape a process runs
has been the slow one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_kernels import _kernel_times  # noqa: E402
from gpu_cases import public_call, scan_case  # noqa: E402
from launch_cost import host_us  # noqa: E402

from m2ops.bench.peers import _graphed  # noqa: E402
from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.bench.timing import median_ms  # noqa: E402
from m2ops.kernels import launch  # noqa: E402

_ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _alloc_counts():
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in _ALLOC_STATS}


def measure(case, block):
    launch.STATE_BLOCK_OVERRIDE = None if block == "default" else int(block)
    launch.clear_plans()
    call = lambda: public_call(case)  # noqa: E731
    before = _alloc_counts()
    eager = median_ms(call, device="cuda")
    after = _alloc_counts()
    row = dict(block=block, eager_ms=eager, graph_ms=median_ms(_graphed(call), device="cuda"),
               host_us=host_us(call, 50, per_call_s=500e-6), alloc={k: after[k] - before[k] for k in _ALLOC_STATS},
               kernels=_kernel_times(call))
    launch.STATE_BLOCK_OVERRIDE = None
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4K:512,4K:64")
    ap.add_argument("--blocks", default="default,512,4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), 256)
        blocks = args.blocks.split(",")
        for rnd, order in enumerate((blocks, blocks[::-1])):
            for block in order:
                row = dict(shape=spec, round=rnd, **measure(case, block))
                rows.append(row)
                print(f"{spec} round {rnd} block {block:>7}: eager {row['eager_ms']:.4f} ms, graph "
                      f"{row['graph_ms']:.4f} ms, host {row['host_us']:.0f} us, allocator {row['alloc']}, kernels "
                      f"{ {k: round(v, 4) for k, v in row['kernels'].items()} }", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
