"""Where the Mamba-2 layer spends its GPU time, kernel by kernel, m2ops.Mamba2 against mamba_ssm's Mamba2:

    python measure/layer_profile.py [--modes step,forward,train] [--batches 1,64,256] [--shape 8x4096]
                                    [--d-model 2560] [--json OUT]

Both layers load one state dict (bf16, d_state 128, headdim 64, one group; mamba_ssm on its memory-efficient path
where causal-conv1d is importable). Modes:
  step     one decode step at each --batches (ssm_state in bf16, mamba_ssm's default cache): each kernel's device
           time per step (torch profiler over 50 eager steps, after warm-up), and the step replayed from a CUDA
           graph (harness.median_ms of 100 replays);
  forward  layer(u) at --shape, no gradients: each kernel's device time per call (10 calls);
  train    forward and the gradients of u and every parameter at --shape (10 calls).
The kernels are listed by their profiler names, longest first. --sources N adds, per mode, the N PyTorch ops with
the most device time and the m2ops lines that called them (harness.op_sources): where copies and casts come from.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch

from m2ops import Mamba2


def layers(d_model, mem_eff):
    kw = dict(d_model=d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, rmsnorm=True,
              norm_before_gate=False, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    mine = Mamba2(**kw)
    out = {"m2ops": mine}
    try:
        from mamba_ssm.modules.mamba2 import Mamba2 as Peer
        import mamba_ssm.modules.mamba2 as peer_module
        peer = Peer(**kw, use_mem_eff_path=mem_eff and peer_module.causal_conv1d_fn is not None)
        peer.load_state_dict(mine.state_dict())
        out["mamba_ssm"] = peer
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"mamba_ssm: skipped ({type(e).__name__}: {e})")
    return out


def sources(name, what, fn, n):
    """The top n PyTorch ops of fn by device time, with the m2ops lines that called them (printed and returned)."""
    rows = harness.op_sources(fn, top=n)
    print(f"\n{name} {what}: PyTorch ops by device time per call, with their m2ops callers")
    for r in rows:
        print(f"  {1e3 * r['ms']:10.2f} us  {r['count']:3d}x {r['op']}  <- {' <- '.join(r['stack'])}")
    return {"impl": name, "what": f"{what} sources", "sources": rows}


def report(name, what, kernels, **extra):
    total = sum(kernels.values())
    row = {"impl": name, "what": what, **extra, "kernel_sum_us": 1e3 * total,
           "kernels_us": {k: 1e3 * v for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}}
    head = ", ".join(f"{k} {v:.1f} us" for k, v in extra.items())
    print(f"\n{name} {what}: {head + ', ' if head else ''}kernels {1e3 * total:.1f} us per call")
    for k, v in list(row["kernels_us"].items())[:25]:
        print(f"  {v:10.2f} us  {k}")
    return row


def profile_step(name, layer, b, d_model, n_sources=0):
    h = torch.randn(b, 1, d_model, device="cuda", dtype=torch.bfloat16)
    conv, ssm = layer.allocate_inference_cache(b, 1, dtype=torch.bfloat16)
    ssm = ssm.to(torch.bfloat16)

    def step():
        return layer.step(h, conv, ssm)

    with torch.no_grad():
        kernels = harness.kernel_times(step, reps=50, bucket=lambda s: s[:90])
        replay = harness.graphed(step)
        graph_us = 1e3 * harness.median_ms(replay, runs=100, warmup=10, flush_l2=False)
        extra = [sources(name, f"step batch {b}", step, n_sources)] if n_sources and name == "m2ops" else []
    return [report(name, f"step batch {b}", kernels, graph_us=graph_us), *extra]


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--modes", type=harness.names, default=["step", "forward", "train"])
    ap.add_argument("--batches", type=harness.sizes, default=[1, 64, 256])
    ap.add_argument("--shape", default="8x4096", help="BATCHxSEQLEN of forward and train (default 8x4096)")
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--sources", type=int, default=0, help="also the top N PyTorch ops by device time, with callers")
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    b, t = (int(v) for v in args.shape.lower().split("x"))
    for name, layer in layers(args.d_model, True).items():
        if "step" in args.modes:
            for batch in args.batches:
                rows.extend(profile_step(name, layer, batch, args.d_model, args.sources))
        u = torch.randn(b, t, args.d_model, device="cuda", dtype=torch.bfloat16)
        if "forward" in args.modes:
            with torch.no_grad():
                rows.append(report(name, f"forward {args.shape}", harness.kernel_times(lambda: layer(u), reps=10,
                                                                                      bucket=lambda s: s[:90])))
                if args.sources and name == "m2ops":
                    rows.append(sources(name, f"forward {args.shape}", lambda: layer(u), args.sources))
        if "train" in args.modes:
            ug = u.detach().requires_grad_(True)
            params = list(layer.parameters())
            g = torch.randn_like(u)
            rows.append(report(name, f"train {args.shape}", harness.kernel_times(
                lambda: torch.autograd.grad(layer(ug), [ug, *params], g), reps=10, bucket=lambda s: s[:90])))
            if args.sources and name == "m2ops":
                rows.append(sources(name, f"train {args.shape}",
                                    lambda: torch.autograd.grad(layer(ug), [ug, *params], g), args.sources))
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
