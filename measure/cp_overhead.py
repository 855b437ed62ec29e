"""What the context-parallel scan costs on one GPU, against the plain call, as a script:

    python measure/cp_overhead.py [--shapes 16K:128,64K:128,256K:128] [--chunk 256] [--json OUT]

One process, a torch.distributed group of one rank (NCCL, through a file store). For each shape (scan_case:
B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D per head, initial states, final states returned) the median time
(harness.median_ms: L2 flushed, CUDA events, median of 100) of the forward alone and of forward + backward
(gradients of x, dt, A, B, C, D, dt_bias and the initial state), for:

- plain: m2ops.mamba_chunk_scan_combined;
- cp group of one: m2ops.distributed.mamba_chunk_scan_combined(group=<one rank>), which exchanges nothing and
  runs the plain call (docs/distributed.md sets its budget: at most 3% over plain);
- exchange path: m2ops.distributed.scan.across on the group of one, everything a rank of a larger group does
  except waiting for the others: the agreement check (one gather of a few integers and a device-to-host copy),
  the summary pass (chunk_cumsum + fwd_pass_state), the gather of the summaries (a copy at one rank), the fold
  and the scan from the entering state; then the same with the agreement check off (M2OPS_CHECK_VALUES=0), as
  under torch.compile;
- summary pass alone: chunk_cumsum + fwd_pass_state on the slice (the compute a rank adds to its plain scan).

Each row gives ms and the ratio to plain, and the exchange path's outputs are compared with plain's (rel_err).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import rel_err, scan_case

import m2ops
from m2ops.distributed import mamba_chunk_scan_combined as cp_scan
from m2ops.distributed import scan as cp_module
from m2ops.distributed.summary import local_summary, pack

LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")


@contextlib.contextmanager
def checks_off():
    old = os.environ.get("M2OPS_CHECK_VALUES")
    os.environ["M2OPS_CHECK_VALUES"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["M2OPS_CHECK_VALUES"]
        else:
            os.environ["M2OPS_CHECK_VALUES"] = old


def variants(pg):
    """name -> (call(case) -> outputs, context)."""
    def plain(case):
        return m2ops.mamba_chunk_scan_combined(**case, return_final_states=True)

    def one(case):
        return cp_scan(**case, return_final_states=True, group=pg)

    def exchange(case):
        return cp_module.across(pg, 0, **case, return_final_states=True)

    def summary(case):
        dt_min, dt_max = case.get("dt_limit", (0.0, float("inf")))
        s = local_summary(case["x"], case["dt"], case["A"], case["B"], case.get("dt_bias"), case.get("seq_idx"),
                          case["chunk_size"], case.get("dt_softplus", False), dt_min, dt_max)
        return (pack(s),)

    on = contextlib.nullcontext
    return {"plain": (plain, on), "cp group of one": (one, on), "exchange path": (exchange, on),
            "exchange path, checks off": (exchange, checks_off), "summary pass alone": (summary, on)}


def timed(call, case):
    """(forward ms, forward + backward ms, outputs)."""
    leaves = [case[k].requires_grad_() for k in LEAVES if case.get(k) is not None]
    outs = call(case)
    seeds = tuple(torch.randn_like(t) for t in outs)

    def forward():
        with torch.no_grad():
            return call(case)

    def both():
        return torch.autograd.grad(call(case), leaves, seeds, allow_unused=True)

    return harness.median_ms(forward), harness.median_ms(both), outs


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "16K:128,64K:128,256K:128")
    harness.add_chunk(ap)
    harness.add_json(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cp_overhead.py needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        try:
            rows = run(args, dist.group.WORLD)
        finally:
            dist.destroy_process_group()
    harness.write_json(args.json, rows)


def run(args, pg):
    rows = []
    table = harness.Table(["shape", "variant", "forward_ms", "forward_x", "both_ms", "both_x", "y_err", "final_err"])
    table.header()
    for T, N, spec in args.shapes:
        case = scan_case(T, N, args.chunk)
        case.pop("cu_seqlens")  # (None: the context-parallel call has no cu_seqlens)
        base = None
        for name, (call, context) in variants(pg).items():
            with context():
                fwd, both, outs = timed(call, case)
            if base is None:
                base = (fwd, both, outs)
            same = name != "summary pass alone"
            row = dict(shape=spec, variant=name, forward_ms=fwd, forward_x=fwd / base[0], both_ms=both,
                       both_x=both / base[1], y_err=rel_err(outs[0], base[2][0]) if same else None,
                       final_err=rel_err(outs[1], base[2][1]) if same else None)
            rows.append(row)
            table.row(row)
            for k in LEAVES:
                if case.get(k) is not None:
                    case[k] = case[k].detach()
    return rows


if __name__ == "__main__":
    main()
