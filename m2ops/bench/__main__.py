"""python -m m2ops.bench: m2ops side by side with mamba_ssm and TileGym (DESIGN.md §4).

Each peer runs in its own worker process, restarted after any failed point; errors and timeouts are recorded
with the result. Writes
results.json (merged with an earlier run's under --resume), results.md and speedup.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .peers import PEERS
from .pool import Pool
from .report import markdown, plot
from .shapes import grid, parse_sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m m2ops.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=parse_sizes, default=parse_sizes("1K,4K,16K,64K,256K"), help="e.g. 1K,4K,16K")
    p.add_argument("--dstates", type=parse_sizes, default=parse_sizes("64,128,256,512"))
    p.add_argument("--peers", default="m2ops,m2ops-graph,mamba_ssm-c64,mamba_ssm-c128,mamba_ssm-c256,tilegym",
                   help=f"comma-separated, from: {', '.join(PEERS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=80)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=128, help="m2ops's chunk size")
    p.add_argument("--runs", type=int, default=100, help="timed runs per point (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per point before it is recorded as a timeout")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--resume", action="store_true", help="keep results already in OUT/results.json")
    p.add_argument("--check", action="store_true",
                   help="also compare m2ops's y and final state (with --backward: its gradients) with the float32 "
                        "reference at every point")
    p.add_argument("--backward", action="store_true",
                   help="time forward+backward: gradients of x, dt, A, B, C, D and the initial state")
    return p.parse_args(argv)


def _progress(total):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="point", file=sys.stderr)
    except ImportError:
        return None


def _measure(pool, a, shape, peer, mode, results, path, bar, counter):
    job = dict(peer=peer, shape=shape.as_dict(), chunk_size=a.chunk_size, runs=a.runs, warmup=a.warmup,
               device=a.device, backward=a.backward, check=a.check)
    t0 = time.perf_counter()
    r = pool.run(peer, job, a.timeout)
    r.update(peer=peer, key=shape.key, mode=mode, shape=shape.as_dict(), floor_ms=shape.floor_ms(backward=a.backward),
             wall_s=round(time.perf_counter() - t0, 1))
    results.append(r)
    with open(path, "w") as f:  # after every point: a killed run keeps what it measured
        json.dump(results, f, indent=1)
    msg = f"{peer:>15} {shape.key}: " + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"][:100])
    if bar is not None:
        bar.update(1)
        bar.write(msg)
    else:
        print(f"{counter} {msg}", flush=True)


def main(argv=None):
    a = parse_args(argv)
    mode = "fwd+bwd" if a.backward else "fwd"
    peers = a.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        sys.exit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    shapes = grid(a.seqlens, a.dstates, batch=a.batch, nheads=a.nheads, headdim=a.headdim, ngroups=a.ngroups,
                  dtype=a.dtype)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "results.json")
    results = []
    if a.resume and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    done = {(r["peer"], r["key"], r.get("mode", "fwd")) for r in results if "ms" in r}
    results = [r for r in results if (r["peer"], r["key"], r.get("mode", "fwd")) in done]
    todo = [(s, p) for s in shapes for p in peers if (p, s.key, mode) not in done]
    bar = _progress(len(todo))
    with Pool() as pool:
        for i, (shape, peer) in enumerate(todo):
            _measure(pool, a, shape, peer, mode, results, path, bar, f"[{i + 1}/{len(todo)}]")
    if bar is not None:
        bar.close()
    results = [r for r in results if r.get("mode", "fwd") == mode]  # the table and plot of this mode
    order = [p for p in PEERS if p in {r["peer"] for r in results}]
    table = f"{mode}, ms\n\n" + markdown(results, order)
    suffix = "" if mode == "fwd" else "-backward"
    with open(os.path.join(a.out, f"results{suffix}.md"), "w") as f:
        f.write(table)
    try:
        plot(results, os.path.join(a.out, f"speedup{suffix}.png"))
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(table)


if __name__ == "__main__":
    main()
