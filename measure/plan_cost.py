"""The planned eager forward's host time (planned.planned_forward, v22), part by part, on a GPU, as a script:

    python measure/plan_cost.py [--shapes 1K:64,4K:64] [--chunk 256] [--n 40] [--ladder ROUNDS]

launch_cost.py splits the launchers' path; this script splits the path an eager call without gradients takes
when its signature has a plan. Each line is the host's time per call of one part, issued while the GPU sleeps
(harness.host_us), in microseconds: the public call, its argument checks, planned_forward, run_forward and
its three pieces, the plan's currency check, every torch.empty the pieces make, and every launch both through
Step.launch and as the bare ct.launch of the resolved kernel. Parts overlap (a piece includes its allocations
and launches), so the lines are not meant to add up to the call. Where the plan runs chunk_cumsum's and chunk_cb's
work in chunk_state's launch (config.current().fused_cumsum, short sequences at chunk 256) the pieces are called as
run_forward calls them, and the launches are that plan's three.
"""

from __future__ import annotations

import torch

import cuda.tile as ct

import harness  # first of the local imports: it puts tests/gpu (gpu_cases) and the repository on sys.path
from gpu_cases import public_call, scan_case
from harness import host_us

from m2ops.kernels import config, forward, index_width, planned, runtime
from m2ops.meta.validate import check_inputs
from m2ops.ops import dispatch, eager


def _captured_args(case):
    """The arguments the public call passes planned_forward."""
    got = []
    planned.CALL_PLANS.clear()  # (else a repeated call goes straight to its kept plan)
    real = planned.planned_forward
    planned.planned_forward = lambda *a: (got.append(a), real(*a))[1]
    try:
        public_call(case)
    finally:
        planned.planned_forward = real
    if not got:
        raise SystemExit("the public call did not reach planned.planned_forward")
    return got[0][:13]  # (without the call key)


def rows(shape, chunk):
    case = scan_case(shape.seqlen, shape.dstate, chunk)
    args = _captured_args(case)
    x, dt, A, B, C, L, D, z, dt_bias, init, softplus, dt_min, dt_max = args
    fp = planned.forward_plan(*args)
    if fp is None or fp.out is None:
        raise SystemExit(f"{shape}: no forward plan")
    bias = dt_bias if dt_bias is not None else A
    seq = runtime.dummy(x, torch.int32, 2)
    Dk = runtime.d_arg(D, x)[0]
    zk = z if z is not None else x
    st, op = fp.states, fp.out
    fused = st.fused_cumsum  # chunk_state's launch also does chunk_cumsum's and chunk_cb's work
    # The launches (five, or three where fused), recorded (and run, so that every buffer holds what a call leaves
    # in it) through the run steps' own go hook: each kernel's step and arrays as run_forward passes them.
    recorded = []
    record = lambda step, arrays: (recorded.append((step, arrays)), step.launch(arrays))  # noqa: E731
    cb = torch.empty(op.cb_shape, dtype=op.cb_dtype, device=x.device)
    if fused:
        dt_out, cs = (torch.empty(fp.cumsum_shape, dtype=torch.float32, device=x.device) for _ in range(2))
    else:
        dt_out, cs = forward.run_cumsum(fp.cumsum, fp.cumsum_shape, dt, A, bias, go=record)
    fused_arrays = dict(cb_arrays=(C, cb), dt_arrays=(dt, A, bias))  # (read only where fused)
    entering, final = forward.run_states(st, fp.entering_dtype, x, B, dt_out, cs, seq, init, go=record,
                                         **fused_arrays)
    y = forward.run_out(op, x, dt_out, cs, C, B, entering, Dk, zk, seq, cb, go=record, cb_done=fused)
    launches = {step.kernel._pyfunc.__name__.removesuffix("_kernel"): (step, arrays) for step, arrays in recorded}
    out_cb = cb if fused else None  # (run_out allocates C . B^T itself unless it was formed already)
    parts = {
        "public call": lambda: public_call(case),
        "check_inputs": lambda: check_inputs(x, dt, A, B, C, L, D, z, dt_bias, init, None, None, softplus,
                                             (dt_min, dt_max), True, False),
        "the decision and path": lambda: eager.applies(dispatch.kernels_serve(x.device, L, (x, dt, B, C, z)), x,
                                                       (x, dt, B, C, z, A, D, dt_bias, init, None)),
        "planned_forward": lambda: planned.planned_forward(*args),
        "run_forward": lambda: planned.run_forward(fp, x, dt, A, B, C, D, z, dt_bias, init),
        "  _run_cumsum": lambda: forward.run_cumsum(fp.cumsum, fp.cumsum_shape, dt, A, bias),
        "  _run_states": lambda: forward.run_states(st, fp.entering_dtype, x, B, dt_out, cs, seq, init,
                                                    **fused_arrays),
        "  _run_out": lambda: forward.run_out(op, x, dt_out, cs, C, B, entering, Dk, zk, seq, out_cb,
                                              cb_done=fused),
        "  _d_arg": lambda: runtime.d_arg(D, x),
        "  _dummy": lambda: runtime.dummy(x, torch.int32, 2),
        "forward_plan_current": lambda: planned.forward_plan_current(fp),
        "config.current": config.current,
        "torch.autograd._profiler_enabled": torch.autograd._profiler_enabled,
        "empty cumsum f32": lambda: torch.empty(fp.cumsum_shape, dtype=torch.float32, device=x.device),
        "empty local states": lambda: torch.empty(st.states_shape, dtype=st.local_dtype, device=x.device),
        "empty final states": lambda: torch.empty(final.shape, dtype=torch.float32, device=x.device),
        "empty cb": lambda: torch.empty(op.cb_shape, dtype=op.cb_dtype, device=x.device),
        "empty y": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "empty uint8 workspace (all 5 scratch)": lambda: torch.empty((fp.scratch_bytes,), dtype=torch.uint8,
                                                                     device=x.device),
        "uint8 slice .view(dtype).view(shape)": lambda: cb.view(torch.uint8).reshape(-1)[:cb.nbytes]
        .view(op.cb_dtype).view(op.cb_shape),
        "as_strided": lambda: y.as_strided(y.shape, y.stride(), 0),
        "_scratch_views (one allocation, 5 views)": lambda: planned.scratch_views(fp.scratch, fp.scratch_bytes,
                                                                                 x.device),
        "_stream_handle": runtime.stream_handle,
    }
    for name, (step, arrays) in launches.items():
        kernel = index_width.for_args(step.kernel, arrays)
        full = arrays + step.tail
        parts[f"Step.launch {name}"] = lambda step=step, arrays=arrays: step.launch(arrays)
        parts[f"bare ct.launch {name}"] = lambda step=step, kernel=kernel, full=full: ct.launch(
            runtime.stream_handle(), step.grid, kernel, full, programmatic_dependent_launch=step.pdl)
        parts[f"for_args {name}"] = lambda step=step, arrays=arrays: index_width.for_args(step.kernel, arrays)
    return parts


def _run_forward_v22(fp, x, dt, A, B, C, D, z, dt_bias, init):
    """run_forward as v22 had it: each buffer its own torch.empty, each launch checking its arrays' index width
    (with the fused chunk_state launch where the plan has it, which v22 did not)."""
    bias = dt_bias if dt_bias is not None else A
    fused = fp.states.fused_cumsum
    if fused:
        dt_out, cs = (torch.empty(fp.cumsum_shape, dtype=torch.float32, device=x.device) for _ in range(2))
        cb = torch.empty(fp.out.cb_shape, dtype=fp.out.cb_dtype, device=x.device)
    else:
        dt_out, cs = forward.run_cumsum(fp.cumsum, fp.cumsum_shape, dt, A, bias)
        cb = None
    seq = runtime.dummy(x, torch.int32, 2)
    states, final = forward.run_states(fp.states, fp.entering_dtype, x, B, dt_out, cs, seq, init,
                                       cb_arrays=(C, cb), dt_arrays=(dt, A, bias))
    return forward.run_out(fp.out, x, dt_out, cs, C, B, states, runtime.d_arg(D, x)[0], z if z is not None else x,
                           seq, cb, cb_done=fused), final


def ladder(shape, chunk):
    """The public call and the calls it nests, each a step further in (so each difference is what the step
    skips): checks and dispatch, planned_forward, run_forward, its allocations and launches, the bare launches
    alone."""
    case = scan_case(shape.seqlen, shape.dstate, chunk)
    args = _captured_args(case)
    x, dt, A, B, C, L, D, z, dt_bias, init, softplus, dt_min, dt_max = args
    fp = planned.forward_plan(*args)
    parts = rows(shape, chunk)
    launches = [fn for name, fn in parts.items() if name.startswith("bare ct.launch ")]  # (in launch order)
    final_shape = (x.shape[0], x.shape[2], x.shape[3], B.shape[3])

    def bare_with_buffers():
        planned.scratch_views(fp.scratch, fp.scratch_bytes, x.device)
        torch.empty(final_shape, dtype=torch.float32, device=x.device)
        torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for f in launches:
            f()

    def public_without_remembered():
        saved = eager.remembered_call
        eager.remembered_call = lambda *a: None
        try:
            public_call(case)
        finally:
            eager.remembered_call = saved

    return {
        "public call": parts["public call"],
        "public call, its remembered plan declined": public_without_remembered,
        "eager.scan_combined": lambda: eager.scan_combined(x, dt, A, B, C, L, D, z, dt_bias, init, None, softplus,
                                                           dt_min, dt_max),
        "planned_forward": parts["planned_forward"],
        "run_forward": parts["run_forward"],
        "run_forward as in v22 (7 allocations)": lambda: _run_forward_v22(fp, x, dt, A, B, C, D, z, dt_bias, init),
        f"3 allocations + {len(launches)} bare launches": bare_with_buffers,
        f"{len(launches)} bare launches": lambda: [f() for f in launches],
    }


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "1K:64,4K:64")
    harness.add_chunk(ap)
    ap.add_argument("--n", type=int, default=40, help="calls per timing round")
    ap.add_argument("--ladder", type=int, default=0,
                    help="rounds of the nested calls only, interleaved round by round (min per call reported): "
                         "the host's speed drifts between rows measured one after another")
    args = ap.parse_args()
    torch.cuda.init()
    with torch.no_grad():
        for spec in args.shapes:
            if args.ladder:
                fns = ladder(spec, args.chunk)
                got = {k: [] for k in fns}
                for _ in range(args.ladder):
                    for name, fn in fns.items():
                        got[name].append(host_us(fn, args.n, per_call_s=500e-6))
                for name, v in got.items():
                    v.sort()
                    print(f"{spec}: {name:40s} min {v[0]:7.1f}  median {v[len(v) // 2]:7.1f} us", flush=True)
                continue
            for name, fn in rows(spec, args.chunk).items():
                print(f"{spec}: {name:40s} {host_us(fn, args.n, per_call_s=500e-6):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
