"""Host time of the planned eager forward with its scratch kept between calls (planned.planned_scratch) and with a
fresh allocation each call, alternated round by round in one process, as a script:

    M2OPS_AUTOTUNE=0 python measure/scratch_keep.py [--shapes 1K:64,4K:64] [--rounds 4]

Each number is the host's issue time per call in microseconds while the GPU sleeps (harness.host_us). The
host's speed drifts between rounds, so only the two columns of one round compare.
"""

from __future__ import annotations

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case

from m2ops.kernels import planned, runtime


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:64,4K:64")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    keep = planned.SCRATCH_KEEP_BYTES
    for T, N, spec in args.shapes:
        case = scan_case(T, N, 256)
        with torch.no_grad():
            def call():
                return public_call(case)
            for r in range(args.rounds):
                row = []
                for name, nbytes in (("fresh", 0), ("kept", keep)):
                    planned.SCRATCH_KEEP_BYTES = nbytes
                    runtime.clear_plans()
                    call()
                    call()
                    row.append(f"{name} {harness.host_us(call, 40):6.1f}")
                print(f"{spec} round {r}: " + ", ".join(row) + f" us; kept {planned.kept_scratch_bytes()} bytes")
    planned.SCRATCH_KEEP_BYTES = keep


if __name__ == "__main__":
    main()
