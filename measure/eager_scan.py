"""Why an eager call can take longer than its kernels, as a script (the 4K/N=512 question of docs/history.md,
"The host path", 2026-12-01):

    python measure/eager_scan.py [--shapes 4K:512,4K:64] [--blocks default,512,4096] [--json OUT]

For each shape (scan_case: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D and initial states, chunk 256) and each
state_passing block (config.override(state_block=...); "default" is the launcher's own choice; tuning is off), in
one process, it reports:
- eager_ms: the public call timed by the benchmark's protocol (harness.median_ms: L2 flushed before each run,
  runs queued back to back, CUDA events, median of 100);
- graph_ms: the same call replayed from a CUDA graph, same protocol;
- host_us: the host's time per call, issued while the GPU sleeps, so that the host never waits on the device
  (harness.host_us);
- alloc: what the caching allocator did during the 100 eager runs (torch.cuda.memory_stats deltas: device
  mallocs and frees, allocation retries, synchronisations of all streams). Any nonzero count there means the
  eager call paid for cudaMalloc / cudaFree, which the graph never does;
- kernels: each kernel's device time in eager calls (torch profiler), to set against the graph's.
Then the eager timing again with the runs in the opposite order of blocks, since the first shape a process runs
has been the slow one.
"""

from __future__ import annotations

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops.kernels import config, runtime

_ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _alloc_counts():
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in _ALLOC_STATS}


def measure(case, block):
    with config.override(state_block=None if block == "default" else int(block)):
        runtime.clear_plans()
        call = lambda: public_call(case)  # noqa: E731
        before = _alloc_counts()
        eager = harness.median_ms(call)
        after = _alloc_counts()
        return dict(block=block, eager_ms=eager, graph_ms=harness.median_ms(harness.graphed(call)),
                    host_us=harness.host_us(call, 50, per_call_s=500e-6),
                    alloc={k: after[k] - before[k] for k in _ALLOC_STATS}, kernels=harness.kernel_times(call))


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "4K:512,4K:64")
    ap.add_argument("--blocks", type=harness.names, default="default,512,4096",
                    help='state_passing blocks, "default": the launcher\'s choice')
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for T, N, spec in args.shapes:
        case = scan_case(T, N, 256)
        blocks = args.blocks
        for rnd, order in enumerate((blocks, blocks[::-1])):
            for block in order:
                row = dict(shape=spec, round=rnd, **measure(case, block))
                rows.append(row)
                print(f"{spec} round {rnd} block {block:>7}: eager {row['eager_ms']:.4f} ms, graph "
                      f"{row['graph_ms']:.4f} ms, host {row['host_us']:.0f} us, allocator {row['alloc']}, kernels "
                      f"{ {k: round(v, 4) for k, v in row['kernels'].items()} }", flush=True)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
