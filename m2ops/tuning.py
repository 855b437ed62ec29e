"""Tuning ahead of time: run the scan once per shape on the GPU so that the tuning cache holds a choice for
each before the shapes matter (a first eager call would otherwise search then, within its budget; calls
under CUDA-graph capture or torch.compile never search and use the default).

    import m2ops
    m2ops.pretune([dict(seqlen=16384, nheads=80, headdim=64, dstate=128)])

    python -m m2ops.tuning --seqlens 4096,16384 --dstates 64,128 --nheads 80 --headdim 64

What is tuned (m2ops.kernels.launch.chunk_scan_configs): the path of the chunk_scan op (the fwd_pass_state
and compute_out kernels at each state-pass block size, on sub-chunks of 64 or 128, or, for a caller's chunk of 64
or 128, on chunks of 256, which is also the default from 16K tokens; or the fused segment kernels at several
segment counts). Results are keyed by GPU, cuda-tile and tileiras versions, dtype and shape class, in
M2OPS_TUNING_CACHE (default ~/.cache/m2ops/tuning.json); M2OPS_AUTOTUNE=0 turns searching off and
M2OPS_TUNE_BUDGET_S (default 20) bounds the seconds a new shape class may spend.
"""

from __future__ import annotations

import argparse

import torch

from .bench.shapes import parse_sizes

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


def pretune(shapes, dtype=torch.bfloat16, device="cuda") -> list[dict]:
    """Tune each shape (a dict with seqlen and any of batch, nheads, headdim, ngroups, dstate, chunk_size,
    seq_idx, D, z; defaults in DEFAULTS) on the GPU and return, per shape, its tuning key and the chosen
    configuration (None where the kernels do not run: the reference then serves the shape)."""
    shapes = list(shapes)
    for shape in shapes:
        if not isinstance(shape, dict) or "seqlen" not in shape:
            raise ValueError(f"pretune: each shape must be a dict with a seqlen, got {shape!r}")
        unknown = sorted(set(shape) - set(DEFAULTS) - {"seqlen"})
        if unknown:
            raise ValueError(f"pretune: unknown shape keys {unknown}; expected seqlen and any of {sorted(DEFAULTS)}")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"pretune needs a CUDA device (got {device}; torch.cuda.is_available() is "
                           f"{torch.cuda.is_available()})")
    from . import mamba_chunk_scan_combined
    from .kernels import autotune, launch
    from .ops import dispatch
    out = []
    for shape in shapes:
        kw = _inputs(shape, dtype, device)
        mamba_chunk_scan_combined(**kw)
        torch.cuda.synchronize(device)
        chunk = dispatch.kernel_chunk_size(kw["chunk_size"], kw["x"].shape[1], device)  # (what the call tuned)
        key = launch.chunk_scan_shape_key(kw["x"], chunk, kw["B"], kw["z"], kw["D"], kw.get("seq_idx"))
        out.append(dict(shape=shape, key=key,
                        config=autotune.lookup(autotune.full_key("chunk_scan", key, device.index or 0))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m m2ops.tuning", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="1K,4K,16K,64K", help="comma-separated; K = 1024")
    ap.add_argument("--dstates", default="64,128,256")
    for k in ("batch", "nheads", "headdim", "ngroups", "chunk_size"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=DEFAULTS[k])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    shapes = [dict(seqlen=T, dstate=n, batch=args.batch, nheads=args.nheads, headdim=args.headdim,
                   ngroups=args.ngroups, chunk_size=args.chunk_size)
              for T in parse_sizes(args.seqlens) for n in parse_sizes(args.dstates)]
    for r in pretune(shapes, dtype=getattr(torch, args.dtype)):
        print(f"{r['key']}: {r['config']}")


if __name__ == "__main__":
    main()
