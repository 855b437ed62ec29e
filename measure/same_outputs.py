"""Forward and backward outputs of one m2ops tree at benchmark points, saved for a bit-for-bit comparison with
another tree's (a refactoring must not change them).

    python measure/same_outputs.py save --tree OLD_TREE --dir /tmp/old --points 1K:64,4K:128
    python measure/same_outputs.py save --tree . --dir /tmp/new --points 1K:64,4K:128
    python measure/same_outputs.py compare /tmp/old /tmp/new

The inputs are the benchmark's shape (batch 1, 80 heads, headdim 64, one group, bfloat16 x/B/C, float32 dt/A/D
and initial state, chunk 256, dt_bias and softplus, final state returned), drawn from a fixed seed on the GPU.
Each point saves y and the final state of a call without gradients (the planned path), then y, the final state
and the gradients of x, dt, A, B, C, D, dt_bias and the initial state of a training call. Run both trees with
M2OPS_AUTOTUNE=0 and an empty M2OPS_TUNING_CACHE so that neither searches nor reads stored configurations.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_points(text: str) -> list[tuple[int, int]]:
    def tokens(s):
        s = s.strip().upper()
        return int(s[:-1]) * 1024 if s.endswith("K") else int(s)
    return [(tokens(p.split(":")[0]), int(p.split(":")[1])) for p in text.split(",") if p]


def save(tree: str, out_dir: str, points, device: str = "cuda") -> None:
    sys.path.insert(0, os.path.abspath(tree))
    import torch
    import m2ops
    assert os.path.abspath(m2ops.__file__).startswith(os.path.abspath(tree)), m2ops.__file__
    os.makedirs(out_dir, exist_ok=True)
    dev = torch.device(device)
    for T, N in points:
        gen = torch.Generator(device=dev).manual_seed(T * 1000 + N)
        H, P, G = 80, 64, 1

        def rnd(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)
        x = rnd(1, T, H, P, dtype=torch.bfloat16)
        dt = rnd(1, T, H, scale=0.5)
        A = -torch.rand(H, generator=gen, device=dev) - 0.5
        B = rnd(1, T, G, N, dtype=torch.bfloat16, scale=N ** -0.5)
        C = rnd(1, T, G, N, dtype=torch.bfloat16, scale=N ** -0.5)
        D = rnd(H)
        bias = rnd(H, scale=0.1)
        init = rnd(1, H, P, N, scale=0.1)
        kw = dict(chunk_size=256, D=D, dt_bias=bias, initial_states=init, dt_softplus=True, return_final_states=True)
        with torch.no_grad():
            y0, f0 = m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, **kw)
            y0b, f0b = m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, **kw)  # the remembered call
        leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, bias, init)]
        lx, ldt, lA, lB, lC, lD, lbias, linit = leaves
        y1, f1 = m2ops.mamba_chunk_scan_combined(lx, ldt, lA, lB, lC, chunk_size=256, D=lD, dt_bias=lbias,
                                                 initial_states=linit, dt_softplus=True, return_final_states=True)
        gy, gf = rnd(*y1.shape, dtype=y1.dtype), rnd(*f1.shape, scale=0.1)
        torch.autograd.backward((y1, f1), (gy, gf))
        out = {"y_nograd": y0, "final_nograd": f0, "y_again": y0b, "final_again": f0b, "y": y1.detach(),
               "final": f1.detach()}
        out.update({f"grad_{n}": t.grad for n, t in zip(("x", "dt", "A", "B", "C", "D", "dt_bias", "init"), leaves)})
        torch.save({k: v.cpu() for k, v in out.items()}, os.path.join(out_dir, f"{T}_{N}.pt"))
        print(f"saved T={T} N={N}", flush=True)


def compare(a_dir: str, b_dir: str) -> int:
    import torch
    bad = 0
    for name in sorted(os.listdir(a_dir)):
        a = torch.load(os.path.join(a_dir, name))
        b = torch.load(os.path.join(b_dir, name))
        same = [k for k in a if torch.equal(a[k], b[k])]
        diff = {k: ((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-30)).item()
                for k in a if k not in same}
        bad += bool(diff)
        print(f"{name[:-3]}: {len(same)}/{len(a)} identical" + (f"; differ: {diff}" if diff else ""))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--tree", required=True, help="root of the m2ops tree to import")
    s.add_argument("--dir", required=True, help="where to write one .pt file per point")
    s.add_argument("--device", default="cuda", help="cpu runs the reference (a check of this script)")
    s.add_argument("--points", default="1K:64,1K:128,1K:256,1K:512,4K:64,4K:128,4K:256,4K:512,"
                                       "16K:64,16K:128,16K:256,16K:512,64K:64,64K:128,64K:256,64K:512")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.tree, args.dir, parse_points(args.points), args.device)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
