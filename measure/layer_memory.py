"""What is alive on the GPU at the peak of one training step of m2ops.Mamba2 (forward, then the gradients of the
input and every parameter), by the line that allocated it:

    python measure/layer_memory.py [--shape 8x4096] [--d-model 2560] [--top 25] [--json OUT]

bf16, d_state 128, headdim 64, one group (m2ops.bench.layer's training step). torch.cuda.memory's allocation
history (Python stacks) over one step after a warm-up step; the live blocks are replayed from its events to the
moment their sum is largest. Prints the peak above what was allocated before the step (the number the layer
bench reports), then the blocks alive there, largest first, each with its size, and the innermost
m2ops frames that allocated it (PyTorch's autograd engine where no m2ops frame is on the stack).
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch

from m2ops import Mamba2


def where(frames, n=3):
    own = [f"{f['filename'].split('m2ops/', 1)[-1]}:{f['line']} {f['name']}" for f in frames
           if "/m2ops/" in f["filename"] and "/measure/" not in f["filename"]]
    if own:
        return " <- ".join(own[:n])
    rest = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames if f["filename"]]
    return " <- ".join(rest[:n]) or "?"


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--shape", default="8x4096")
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--top", type=int, default=25)
    harness.add_json(ap)
    args = ap.parse_args()
    b, t = (int(v) for v in args.shape.lower().split("x"))
    torch.manual_seed(0)
    layer = Mamba2(d_model=args.d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, rmsnorm=True,
                   norm_before_gate=False, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(b, t, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(u)
    params = list(layer.parameters())

    def step():
        return torch.autograd.grad(layer(u), [u, *params], g)

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    grads = step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_stat = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    del grads
    live, total, best, at_peak = {}, 0, -1, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > best:
                best, at_peak = total, dict(live)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    print(f"peak above the blocks alive before the step: {peak_stat:.0f} MiB (max_memory_allocated); "
          f"allocated during the step and alive at its peak: {best / 2 ** 20:.0f} MiB")
    by_site = {}
    for size, frames in at_peak.values():
        key = where(frames)
        n, s = by_site.get(key, (0, 0))
        by_site[key] = (n + 1, s + size)
    rows = sorted(({"site": k, "blocks": n, "mib": s / 2 ** 20} for k, (n, s) in by_site.items()),
                  key=lambda r: -r["mib"])
    for r in rows[:args.top]:
        print(f"  {r['mib']:9.1f} MiB  {r['blocks']:3d}x  {r['site']}")
    harness.write_json(args.json, rows, peak_mib=peak_stat, live_at_peak_mib=best / 2 ** 20)


if __name__ == "__main__":
    main()
