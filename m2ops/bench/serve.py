"""python -m m2ops.bench.serve: what a serving engine calls, m2ops against mamba_ssm on the same tensors.

Two workloads (--modes):

  prefill   a chunked-prefill batch: --sequences packed sequences of random lengths (1 token to --max-len, scaled
            to --tokens in all), H heads of headdim P, dstate N, one group, bf16 x/B/C, float32 dt.
              m2ops           mamba_chunk_scan_combined_varlen with one start state per sequence, out=, the
                              final states in float32, meta from prepare_varlen (built once, outside the timing)
              m2ops-no-starts the same call without start states (what mamba_ssm can do)
              mamba_ssm       its mamba_chunk_scan_combined on the batch-1 packed form with seq_idx and
                              cu_seqlens, return_varlen_states=True; it takes no per-sequence start states
            each eager (one call, synchronised) and replayed from a CUDA graph.
  decode    one token into a state cache by slot (state_batch_indices: a random permutation of cache rows,
            cache of 2 x batch rows), at each --decode-batches and --decode-dstates, replayed from a CUDA graph
            (100 steps per replay, the time per step): m2ops.selective_state_update against mamba_ssm's
            selective_state_update, both in place, A/dt/dt_bias in mamba_ssm's broadcast form as engines pass
            them, D per head, z given, dt_softplus.

Outputs (y, final states; the decode outputs and updated cache rows) are compared with m2ops's: the JSON holds the
normwise relative errors. Timing: CUDA events with a synchronisation around each run, warm-up first, median of
--runs. --smoke: tiny sizes on the CPU where there is no GPU (eager only; what the CPU tests run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import torch

from .check import rel_err
from .report import publish
from .timing import graphed, runs_ms, summary

MODES = ("prefill", "decode")
SMOKE = dict(sequences=5, tokens=60, max_len=30, nheads=4, headdim=8, dstate=16, chunk_size=16,
             decode_batches="1,3", decode_dstates="16", runs=2, warmup=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m m2ops.bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: %(default)s")
    p.add_argument("--sequences", type=int, default=64, help="packed sequences (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens in all (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=4096, help="longest sequence (default: %(default)s)")
    p.add_argument("--nheads", type=int, default=80, help="(default: %(default)s)")
    p.add_argument("--headdim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--dstate", type=int, default=128, help="prefill dstate (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--decode-batches", default="1,64,256", help="(default: %(default)s)")
    p.add_argument("--decode-dstates", default="128,256", help="(default: %(default)s)")
    p.add_argument("--cache-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the decode state cache's dtype (default: %(default)s)")
    p.add_argument("--runs", type=int, default=20, help="timed runs, median reported (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes where not given; on the CPU without a GPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            p.error(f"argument --modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    try:
        args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
        args.decode_dstates = [int(n) for n in args.decode_dstates.split(",") if n]
    except ValueError:
        p.error("arguments --decode-batches/--decode-dstates: expected comma-separated positive integers")
    for name in ("sequences", "tokens", "max_len", "nheads", "headdim", "dstate", "chunk_size", "runs"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: expected a positive integer")
    if any(v < 1 for v in args.decode_batches + args.decode_dstates):
        p.error("arguments --decode-batches/--decode-dstates: expected positive integers")
    if args.sequences > args.tokens or args.tokens > args.sequences * args.max_len:
        p.error("--tokens must lie between --sequences and --sequences x --max-len")
    args.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if args.device is None:
        if not args.smoke:
            p.error("no CUDA GPU: use --smoke (tiny sizes on the CPU)")
        args.device = torch.device("cpu")
    return args


def lengths(args) -> list[int]:
    """--sequences random lengths in [1, max_len] summing to --tokens."""
    gen = torch.Generator().manual_seed(args.seed)
    raw = torch.rand(args.sequences, generator=gen) + 0.05
    n = (raw / raw.sum() * args.tokens).floor().clamp(1, args.max_len).long()
    k = 0
    while int(n.sum()) != args.tokens:  # spread the rounding over the sequences that have room
        i = k % args.sequences
        if int(n.sum()) < args.tokens and n[i] < args.max_len:
            n[i] += 1
        elif int(n.sum()) > args.tokens and n[i] > 1:
            n[i] -= 1
        k += 1
    return n.tolist()


def peer():
    """mamba_ssm's scan and decode functions, or the reason they cannot run here."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - any import failure means the peer does not run here
        return None, f"mamba_ssm is not importable ({type(e).__name__}: {e})"
    return (mamba_chunk_scan_combined, selective_state_update), None


def timed(fn, args, graph: bool) -> dict:
    """Eager (or, with graph, CUDA-graph replayed) time of fn() in ms."""
    return summary(runs_ms(graphed(fn) if graph else fn, args.device, args.runs, args.warmup))


def prefill_calls(args, peer_fns) -> tuple[list[int], dict]:
    """The chunked-prefill inputs' lengths and the calls prefill times, by name (each returns (y, states))."""
    import m2ops
    dev, bf = args.device, torch.bfloat16 if args.device.type == "cuda" else torch.float32
    lens = lengths(args)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    T, h, p, n = args.tokens, args.nheads, args.headdim, args.dstate
    gen = torch.Generator().manual_seed(args.seed + 1)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    x, B, C = randn(T, h, p).to(bf), randn(T, 1, n).to(bf), randn(T, 1, n).to(bf)
    dt, A = randn(T, h) - 2.0, -torch.rand(h, generator=gen).to(dev) - 0.5
    D, dt_bias = randn(h), randn(h, scale=0.1)
    starts = randn(args.sequences, h, p, n, scale=0.1)
    meta = m2ops.prepare_varlen(cu, args.chunk_size, dev)
    cu_dev, out = cu.to(dev), torch.empty_like(x)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, out=out, state_dtype=torch.float32, meta=meta)
    calls = {
        "m2ops": lambda: m2ops.mamba_chunk_scan_combined_varlen(x, dt, A, B, C, args.chunk_size, cu_dev,
                                                                initial_states=starts, **kw),
        "m2ops-no-starts": lambda: m2ops.mamba_chunk_scan_combined_varlen(x, dt, A, B, C, args.chunk_size, cu_dev,
                                                                          **kw),
    }
    if peer_fns is not None:
        seq_idx = meta.seq_idx

        def mamba_ssm_call():
            return peer_fns[0](x[None], dt[None], A, B[None], C[None], args.chunk_size, D=D, dt_bias=dt_bias,
                               seq_idx=seq_idx, cu_seqlens=cu_dev, dt_softplus=True, return_varlen_states=True)
        calls["mamba_ssm"] = mamba_ssm_call
    return lens, calls


def prefill(args, peer_fns) -> dict:
    dev = args.device
    lens, calls = prefill_calls(args, peer_fns)
    res = {"lengths": lens}
    with torch.no_grad():
        ref = [t.float().clone() for t in calls["m2ops-no-starts"]()]
        for name, fn in calls.items():
            got = fn()
            y, states = (got[0][0], got[1]) if name == "mamba_ssm" else got
            r = res[name] = {"eager": timed(fn, args, False)}
            if dev.type == "cuda":
                r["graph"] = timed(fn, args, True)
            if name != "m2ops":  # (with start states the results differ by design)
                r["y_rel_err"] = rel_err(y.float(), ref[0])
                r["states_rel_err"] = rel_err(states.float(), ref[1])
    return res


def decode(args, peer_fns, batch: int, n: int) -> dict:
    import m2ops
    dev = args.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, p = args.nheads, args.headdim
    gen = torch.Generator().manual_seed(args.seed + batch * 7 + n)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    cache = randn(2 * batch, h, p, n, scale=0.1).to(getattr(torch, args.cache_dtype))
    slots = torch.randperm(2 * batch, generator=gen)[:batch].to(dev, torch.int32)
    x, z = randn(batch, h, p).to(dtype), randn(batch, h, p).to(dtype)
    B, C = randn(batch, 1, n).to(dtype), randn(batch, 1, n).to(dtype)
    # mamba_ssm's broadcast forms, as engines pass them
    A = (-torch.rand(h, generator=gen).to(dev) - 0.5)[:, None, None].expand(h, p, n)
    dt = (randn(batch, h) - 2.0).to(dtype)[..., None].expand(batch, h, p)
    dt_bias, D = randn(h, scale=0.1)[:, None].expand(h, p), randn(h)[:, None].expand(h, p)
    impls = {"m2ops": m2ops.selective_state_update}
    if peer_fns is not None:
        impls["mamba_ssm"] = peer_fns[1]
    res, outs = {}, {}
    with torch.no_grad():
        for name, fn in impls.items():
            state, out = cache.clone(), torch.empty_like(x)
            kw = {"out": out} if name == "m2ops" else {}

            def step(fn=fn, state=state, kw=kw):
                return fn(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                          state_batch_indices=slots, **kw)

            outs[name] = (step().float().clone(), state[slots.long()].float().clone())  # one step from the cache
            if dev.type == "cuda":
                reps = 100
                timed_res = timed(lambda: [step() for _ in range(reps)], args, True)
                res[name] = {"graph_us": 1e3 * timed_res["median_ms"] / reps}
            else:
                res[name] = {"eager_us": 1e3 * statistics.median(runs_ms(step, dev, args.runs, args.warmup))}
        if "mamba_ssm" in outs:
            res["mamba_ssm"]["y_rel_err"] = rel_err(outs["mamba_ssm"][0], outs["m2ops"][0])
            res["mamba_ssm"]["state_rel_err"] = rel_err(outs["mamba_ssm"][1], outs["m2ops"][1])
    return res


def markdown(result) -> str:
    cfg, res = result["config"], result["results"]
    lines = [f"on {result['env']['device']}, median of {cfg['runs']} runs", ""]
    if "prefill" in res:
        pre = res["prefill"]
        lines += [f"Chunked prefill: {cfg['sequences']} sequences, {cfg['tokens']} tokens, H={cfg['nheads']} "
                  f"P={cfg['headdim']} N={cfg['dstate']} chunk {cfg['chunk_size']}", "",
                  "| | eager ms | graph ms |", "|---|---|---|"]
        for name in ("m2ops", "m2ops-no-starts", "mamba_ssm"):
            if name in pre:
                g = pre[name].get("graph", {}).get("median_ms")
                lines.append(f"| {name} | {pre[name]['eager']['median_ms']:.3f} | "
                             f"{'-' if g is None else f'{g:.3f}'} |")
        lines.append("")
    rows = [k for k in res if k.startswith("decode")]
    if rows:
        lines += ["Decode into a cache by slot, per step (us)", "", "| batch, dstate | m2ops | mamba_ssm | × |",
                  "|---|---|---|---|"]
        for k in rows:
            r = res[k]
            key = "graph_us" if "graph_us" in r["m2ops"] else "eager_us"
            mine, theirs = r["m2ops"][key], r.get("mamba_ssm", {}).get(key)
            lines.append(f"| {k[len('decode '):]} | {mine:.2f} | {'-' if theirs is None else f'{theirs:.2f}'} | "
                         f"{'-' if theirs is None else f'{theirs / mine:.2f}'} |")
    if "peer_skipped" in result:
        lines += ["", f"- mamba_ssm: {result['peer_skipped']}"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    peer_fns, why = peer()
    result = {"config": {k: getattr(args, k) for k in ("modes", "sequences", "tokens", "max_len", "nheads",
                                                       "headdim", "dstate", "chunk_size", "decode_batches",
                                                       "decode_dstates", "cache_dtype", "runs", "warmup", "seed",
                                                       "smoke")},
              "env": {"torch": torch.__version__, "python": platform.python_version(),
                      "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "CPU"},
              "results": {}}
    if why is not None:
        result["peer_skipped"] = why
        print(f"mamba_ssm: skipped: {why}", file=sys.stderr, flush=True)
    if "prefill" in args.modes:
        result["results"]["prefill"] = prefill(args, peer_fns)
    if "decode" in args.modes:
        for n in args.decode_dstates:
            for b in args.decode_batches:
                result["results"][f"decode {b}, {n}"] = decode(args, peer_fns, b, n)
    return publish(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
