"""One public call under the profiler's start/stop markers, for Nsight Compute, as a script:

    ncu --clock-control none --profile-from-start off --set full -o OUT/scan \
        python measure/ncu_scan.py --shape 16K:128 --chunk 256 [--backward] [--peer NAME]

Warm-up calls (JIT compiles, allocator) run before cudaProfilerStart, so only the timed call's kernels are
profiled. Shape as profile_scan.py: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states.
--backward profiles forward and backward together (the gradients of x, dt, A, B, C, D and the initial state, as
backward_scan.py takes them); `-k regex:out_bwd|chunk_state` keeps ncu to the kernels of interest.
--peer profiles one of the benchmark's peers instead, on the benchmark's inputs (m2ops.bench.peers: e.g.
`--peer tilegym-tuned -k regex:compute_out` for TileGym's output kernel after its own search, which the warm-up
calls run before profiling starts).
"""

from __future__ import annotations

import torch

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import forward_and_backward, scan_case


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128", one=True)
    harness.add_chunk(ap)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward")
    ap.add_argument("--peer", default=None, help="a peer of m2ops.bench (e.g. tilegym-tuned, mamba_ssm-c256)")
    args = ap.parse_args()
    seqlen, dstate = args.shape.seqlen, args.shape.dstate
    if args.peer:
        from m2ops.bench import peers
        from m2ops.bench.shapes import Shape
        call = peers.build(args.peer, peers.make_inputs(Shape(seqlen, dstate), "cuda"), args.chunk, args.backward)
    else:
        forward, both = forward_and_backward(scan_case(seqlen, dstate, args.chunk))
        call = both if args.backward else forward
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
