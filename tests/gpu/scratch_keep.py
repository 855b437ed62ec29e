"""Host time of the planned eager forward with its scratch kept between calls (launch._planned_scratch) and with a
fresh allocation each call, alternated round by round in one process, as a script:

    M2OPS_AUTOTUNE=0 python tests/gpu/scratch_keep.py [--shapes 1K:64,4K:64] [--rounds 4]

Each number is the host's issue time per call in microseconds while the GPU sleeps (launch_cost.host_us). The
host's speed drifts between rounds, so only the two columns of one round compare.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import public_call, scan_case  # noqa: E402
from launch_cost import host_us  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402
from m2ops.kernels import launch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1K:64,4K:64")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    keep = launch.SCRATCH_KEEP_BYTES
    for spec in args.shapes.split(","):
        t_s, n_s = spec.split(":")
        case = scan_case(parse_sizes(t_s)[0], int(n_s), 256)
        with torch.no_grad():
            def call():
                return public_call(case)
            for r in range(args.rounds):
                row = []
                for name, nbytes in (("fresh", 0), ("kept", keep)):
                    launch.SCRATCH_KEEP_BYTES = nbytes
                    launch.clear_plans()
                    call()
                    call()
                    row.append(f"{name} {host_us(call, 40):6.1f}")
                print(f"{spec} round {r}: " + ", ".join(row) + f" us; kept {launch.kept_scratch_bytes()} bytes")
    launch.SCRATCH_KEEP_BYTES = keep


if __name__ == "__main__":
    main()
