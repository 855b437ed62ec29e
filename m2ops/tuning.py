"""Tuning ahead of time: search chunk_scan's launch configurations for given shapes on the GPU and store the
results in the tuning cache, so that later calls (and processes) use them. A plain call never searches: it runs
the stored configuration for its shape class, else the default (m2ops/kernels/autotune.py).

    import m2ops
    m2ops.pretune([dict(seqlen=16384, nheads=80, headdim=64, dstate=128)])

    python -m m2ops.tuning --seqlens 4096,16384 --dstates 64,128 --nheads 80 --headdim 64

What is tuned (m2ops.kernels.scan.chunk_scan_configs): the path of the chunk_scan op (the fwd_pass_state
and compute_out kernels at each state-pass block size, on sub-chunks of 64 or 128, or, for a caller's chunk of 64
or 128, on chunks of 256, which is also the default from 4K tokens; or the fused segment kernels at several
segment counts). A shape class already in the cache is not searched again. Results are keyed by GPU, cuda-tile,
tileiras and m2ops versions, kernel sources, candidate list, dtype and shape class, in M2OPS_TUNING_CACHE
(default $XDG_CACHE_HOME/m2ops/tuning.json, else ~/.cache/m2ops/tuning.json); M2OPS_TUNE_BUDGET_S (default 20),
or pretune's budget_s, bounds the seconds one shape class may spend. Progress goes to the logger "m2ops.tuning":
silent in a library call unless the application configures logging, shown by the command line.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .bench.shapes import parse_sizes

log = logging.getLogger("m2ops.tuning")

DEFAULTS = dict(batch=1, nheads=80, headdim=64, ngroups=1, dstate=128, chunk_size=256, seq_idx=False, D=True,
                z=False)


def _inputs(shape: dict, dtype, device):
    s = {**DEFAULTS, **shape}
    b, T, h, p, g, n = s["batch"], s["seqlen"], s["nheads"], s["headdim"], s["ngroups"], s["dstate"]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape_, scale=1.0):
        return (torch.randn(*shape_, generator=gen) * scale).to(device)

    kw = dict(x=randn(b, T, h, p).to(dtype), dt=randn(b, T, h), A=-torch.exp(randn(h, scale=0.5)),
              B=randn(b, T, g, n, scale=n ** -0.25).to(dtype), C=randn(b, T, g, n, scale=n ** -0.25).to(dtype),
              chunk_size=s["chunk_size"], D=randn(h) if s["D"] else None,
              z=randn(b, T, h, p).to(dtype) if s["z"] else None, dt_bias=randn(h), dt_softplus=True)
    if s["seq_idx"]:
        kw["seq_idx"] = (torch.arange(T, device=device) * 4 // max(T, 1)).to(torch.int32).expand(b, T).contiguous()
    return kw


def pretune(shapes, dtype=torch.bfloat16, device="cuda", budget_s=None) -> list[dict]:
    """Tune each shape (a dict with seqlen and any of batch, nheads, headdim, ngroups, dstate, chunk_size,
    seq_idx, D, z; defaults in DEFAULTS) on the GPU: one call of the scan per shape, during which a shape class
    without a stored configuration is searched (autotune.searching) and its winner stored. Returns, per shape,
    its shape key, the stored configuration (None where the kernels do not run: the reference then serves the
    shape) and its time in ms. budget_s: seconds one shape class may spend searching (default
    M2OPS_TUNE_BUDGET_S, else 20)."""
    shapes = list(shapes)
    for shape in shapes:
        if not isinstance(shape, dict) or "seqlen" not in shape:
            raise ValueError(f"pretune: each shape must be a dict with a seqlen, got {shape!r}")
        unknown = sorted(set(shape) - set(DEFAULTS) - {"seqlen"})
        if unknown:
            raise ValueError(f"pretune: unknown shape keys {unknown}; expected seqlen and any of {sorted(DEFAULTS)}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                 or not budget_s >= 0):
        raise ValueError(f"pretune: budget_s must be a number of seconds >= 0 or None, got {budget_s!r}")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"pretune needs a CUDA device (got {device}; torch.cuda.is_available() is "
                           f"{torch.cuda.is_available()})")
    from . import mamba_chunk_scan_combined
    from .kernels import autotune, scan
    from .ops import dispatch
    out = []
    with autotune.searching(budget_s=budget_s):
        for i, shape in enumerate(shapes):
            log.info("pretune %d/%d: %s", i + 1, len(shapes), shape)
            kw = _inputs(shape, dtype, device)
            mamba_chunk_scan_combined(**kw)
            torch.cuda.synchronize(device)
            x = kw["x"]
            chunk = dispatch.kernel_chunk_size(kw["chunk_size"], x.shape[1], x.device,  # (what the call tuned)
                                               (x, kw["dt"], kw["B"], kw["C"], kw["z"]))
            key = scan.chunk_scan_shape_key(x, chunk, kw["B"], kw["z"], kw["D"], kw.get("seq_idx"))
            entry = autotune.stored("chunk_scan", key, x.device.index or 0)
            out.append(dict(shape=shape, key=key, config=None if entry is None else entry["config"],
                            ms=None if entry is None else entry.get("ms")))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m m2ops.tuning", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="1K,4K,16K,64K", help="comma-separated; K = 1024")
    ap.add_argument("--dstates", default="64,128,256")
    for k in ("batch", "nheads", "headdim", "ngroups", "chunk_size"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=DEFAULTS[k])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds one shape class may spend searching (default: M2OPS_TUNE_BUDGET_S, else 20)")
    ap.add_argument("-v", "--verbose", action="store_true", help="also log why a configuration failed")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress, only the results")
    args = ap.parse_args(argv)
    sizes = {}
    for name in ("seqlens", "dstates"):
        try:
            sizes[name] = parse_sizes(getattr(args, name))
        except ValueError as e:
            ap.error(f"--{name}: {e}")
    shapes = [dict(seqlen=T, dstate=n, batch=args.batch, nheads=args.nheads, headdim=args.headdim,
                   ngroups=args.ngroups, chunk_size=args.chunk_size)
              for T in sizes["seqlens"] for n in sizes["dstates"]]
    if args.budget_s is not None and not args.budget_s >= 0:
        ap.error(f"--budget-s: expected a number of seconds >= 0, got {args.budget_s}")
    if not torch.cuda.is_available():
        sys.exit("python -m m2ops.tuning: needs a CUDA device (torch.cuda.is_available() is False)")
    # The library logs without a handler of its own (silent unless the application configures logging); the
    # command line shows its progress on stderr, for its own run only.
    logger = logging.getLogger("m2ops")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("m2ops: %(message)s"))
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    from .kernels import autotune
    try:
        results = pretune(shapes, dtype=getattr(torch, args.dtype), budget_s=args.budget_s)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    for r in results:
        ms = "" if r["ms"] is None else f" ({r['ms']:.4f} ms)"
        print(f"{r['key']}: {r['config']}{ms}")
    print(f"stored in {autotune.cache_path()}")


if __name__ == "__main__":
    main()
