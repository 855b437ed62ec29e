"""Wall time of the first plain eager call in a new process (imports, kernel compiles or cuTile's on-disk cache,
plans), then of the second call, for one shape.

    python measure/first_call.py --seqlen 4096 --dstate 128        # run twice: the second process finds the
                                                                   # first's compiled kernels on disk
A plain call never searches launch configurations (M2OPS_AUTOTUNE unset), so what it costs is compiling (or
loading) the kernels it launches.
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()
import torch  # noqa: E402

import m2ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--backward", action="store_true", help="also the gradients of x, dt, A, B, C, D")
    args = ap.parse_args()
    imported = time.perf_counter() - T0
    dev = torch.device("cuda")
    T, H, P, N = args.seqlen, args.nheads, args.headdim, args.dstate
    x = torch.randn(1, T, H, P, device=dev, dtype=torch.bfloat16)
    dt = torch.rand(1, T, H, device=dev)
    A = -torch.rand(H, device=dev) - 0.5
    B = torch.randn(1, T, 1, N, device=dev, dtype=torch.bfloat16)
    C = torch.randn(1, T, 1, N, device=dev, dtype=torch.bfloat16)
    D = torch.randn(H, device=dev)
    leaves = [x, dt, A, B, C, D]
    if args.backward:
        for t in leaves:
            t.requires_grad_()
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=256, D=D)
        if args.backward:
            y.float().square().sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "seqlen": T, "dstate": N, "backward": args.backward,
                      "import_s": round(imported, 3), "first_call_s": round(times[0], 3),
                      "second_call_s": round(times[1], 4)}))


if __name__ == "__main__":
    main()
