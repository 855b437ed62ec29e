"""Where one decode step of the Mamba-2 layer spends its GPU time, m2ops.Mamba2 against mamba_ssm's Mamba2:

    python measure/step_profile.py [--batches 1,64,256] [--d-model 2560] [--json OUT]

Both layers load one state dict (bf16, d_state 128, headdim 64, one group, ssm_state in bf16 as mamba_ssm's
default cache); for each batch, each kernel's device time per step (torch profiler over 50 eager steps, after
warm-up) and their sum, and the step replayed from a CUDA graph (harness.median_ms of 100 replays). The kernels
are listed by their profiler names, longest first: what a fusion of the step would remove.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch

from m2ops import Mamba2


def layers(d_model):
    kw = dict(d_model=d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, rmsnorm=True,
              norm_before_gate=False, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    mine = Mamba2(**kw)
    out = {"m2ops": mine}
    try:
        from mamba_ssm.modules.mamba2 import Mamba2 as Peer
        peer = Peer(**kw)
        peer.load_state_dict(mine.state_dict())
        out["mamba_ssm"] = peer
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"mamba_ssm: skipped ({type(e).__name__}: {e})")
    return out


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--batches", type=harness.sizes, default=[1, 64, 256])
    ap.add_argument("--d-model", type=int, default=2560)
    harness.add_json(ap)
    args = ap.parse_args()
    rows = []
    for name, layer in layers(args.d_model).items():
        for b in args.batches:
            h = torch.randn(b, 1, args.d_model, device="cuda", dtype=torch.bfloat16)
            conv, ssm = layer.allocate_inference_cache(b, 1, dtype=torch.bfloat16)
            ssm = ssm.to(torch.bfloat16)

            def step(layer=layer, h=h, conv=conv, ssm=ssm):
                return layer.step(h, conv, ssm)

            with torch.no_grad():
                kernels = harness.kernel_times(step, reps=50, bucket=lambda s: s[:90])
                replay = harness.graphed(step)
                graph_us = 1e3 * harness.median_ms(replay, runs=100, warmup=10, flush_l2=False)
            total = sum(kernels.values())
            rows.append({"impl": name, "batch": b, "graph_us": graph_us, "kernel_sum_us": 1e3 * total,
                         "kernels_us": {k: 1e3 * v for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}})
            print(f"\n{name} batch {b}: graph {graph_us:.1f} us, kernels {1e3 * total:.1f} us per step")
            for k, v in rows[-1]["kernels_us"].items():
                print(f"  {v:8.2f} us  {k}")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
