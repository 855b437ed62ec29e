"""Where the host's time goes in one public call, on a GPU, as a script:

    python measure/host_scan.py [--shapes 4K:128,1K:128] [--chunk 256] [--rows 30] [--spin SECONDS]

A call is host-bound when the Python that issues its kernels takes longer than the kernels themselves (the
eager forward at T <= 4K, forward + backward at T <= 16K on an H200). For each shape (as backward_scan.py: B=1,
H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states) this prints the host time per call of the
forward and of forward + backward (the wall time of issuing a few calls while the GPU sleeps, against the
device time of the same calls run back to back afterwards: harness.host_us), then cProfile's functions by own
time over 20 calls of forward + backward: cuTile's launch, PyTorch's operators and the custom-op machinery each
appear under their own names (cProfile inflates Python-heavy frames, and torch's dynamo-disable wrapper confuses
its attribution).
--spin S then calls forward + backward for S seconds more, for a sampling profiler outside the process:
    py-spy record -r 500 -f raw -o OUT/spy.txt -- python measure/host_scan.py --shapes 4K:128 --spin 15
"""

from __future__ import annotations

import time

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import forward_and_backward, scan_case


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "4K:128,1K:128")
    harness.add_chunk(ap)
    ap.add_argument("--rows", type=int, default=30, help="cProfile's rows")
    ap.add_argument("--spin", type=float, default=0.0, help="seconds of forward+backward calls at the end")
    args = ap.parse_args()
    for T, N, spec in args.shapes:
        forward, both = forward_and_backward(scan_case(T, N, args.chunk))

        for name, fn in (("forward", forward), ("forward+backward", both)):
            # 7 rounds of 5 calls, the sleep twice one call's time per call
            host, dev = harness.host_us(fn, 5, per_call_s=None, rounds=7, device_time=True)
            print(f"{spec} {name}: host {host:.0f} us per call, device {dev:.0f} us per call")
        table = harness.cprofile(both, 20, args.rows)
        print(f"{spec} forward+backward, 20 calls under cProfile, by own time:")
        print(table)
        t_end = time.perf_counter() + args.spin
        while time.perf_counter() < t_end:
            both()


if __name__ == "__main__":
    main()
