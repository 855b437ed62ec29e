"""Where chunked prefill with a start state per sequence spends its GPU time, against the same call without them:

    python measure/serve_profile.py [bench.serve's prefill options, e.g. --sequences 64 --tokens 16384] [--json OUT]

The inputs are m2ops.bench.serve's (prefill_calls). For each call ("m2ops": start states, "m2ops-no-starts"): each
kernel's device time per call (harness.kernel_times, by short name), then the PyTorch ops with the most device
time and the m2ops lines that called them (harness.op_sources): which of the start-state corrections
(m2ops/sequence_states.py) cost what.
"""

from __future__ import annotations

import sys

import harness  # first of the local imports: it puts the repository on sys.path
import torch

from m2ops.bench.kernels import short_name
from m2ops.bench.serve import prefill_calls


def main():
    args, json_path = harness.serve_prefill_args(sys.argv[1:])
    lens, calls = prefill_calls(args, None)
    rows = []
    with torch.no_grad():
        for name in ("m2ops", "m2ops-no-starts"):
            fn = calls[name]
            kernels = harness.kernel_times(fn, reps=10, bucket=short_name)
            total = sum(kernels.values())
            print(f"\n{name}: kernels {1e3 * total:.1f} us per call")
            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:20]:
                print(f"  {1e3 * v:10.2f} us  {k}")
            src = harness.op_sources(fn, top=15)
            print(f"{name}: PyTorch ops by device time per call, with their m2ops callers")
            for r in src:
                print(f"  {1e3 * r['ms']:10.2f} us  {r['count']:3d}x {r['op']}  <- {' <- '.join(r['stack'])}")
            rows.append({"call": name, "kernel_sum_us": 1e3 * total,
                         "kernels_us": {k: 1e3 * v for k, v in kernels.items()}, "sources": src})
    harness.write_json(json_path, rows, lengths=lens)


if __name__ == "__main__":
    main()
