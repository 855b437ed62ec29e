"""Results as a markdown table and a PNG plot of m2ops's speedup over each peer; the JSON and printed table every
benchmark entry point ends with."""

from __future__ import annotations

import json
from collections import defaultdict


def save_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def publish(result: dict, table: str, path: str | None) -> dict:
    """The end of a benchmark run: table kept in result["markdown"] and printed, result written as JSON to path
    (when given). Returns result."""
    result["markdown"] = table
    print(table)
    if path:
        save_json(result, path)
        print(f"wrote {path}")
    return result


def _fmt_ms(r, floor=None):
    """ms, with its multiple of the floor in parentheses where the floor is known."""
    if r is None:
        return ""
    if "error" in r:
        return "fails: " + r["error"].replace("|", "/")[:60]
    return f"{r['ms']:.3f}" + (f" ({r['ms'] / floor:.1f})" if floor else "")


def _ratio(r, ours):
    """r's time over m2ops's (ours), where both were measured, else an empty cell."""
    return f"{r['ms'] / ours['ms']:.2f}" if ours and "ms" in ours and r and "ms" in r else ""


def ours_for(peer: str) -> str:
    """The m2ops row a peer's speedup is taken against: a CUDA-graph replay ("-graph") against m2ops's own
    replay, an eager call against m2ops's eager call."""
    return "m2ops-graph" if peer.endswith("-graph") else "m2ops"


def _speedup_head(peer: str) -> str:
    return f"× vs {peer}" if ours_for(peer) == "m2ops" else f"× m2ops-graph vs {peer}"


def markdown(results: list[dict], peers: list[str]) -> str:
    """One row per shape: each peer's ms and its multiple of the floor, m2ops's speedup over it (ours_for: eager
    against eager, graph replay against graph replay), and the floor."""
    by_shape = defaultdict(dict)
    shapes = {}
    for r in results:
        by_shape[r["key"]][r["peer"]] = r
        shapes[r["key"]] = r
    others = [p for p in peers if not p.startswith("m2ops")]
    checked = any("err_y" in r for r in results)
    grads_checked = any("err_grad_max" in r for r in results)
    # m2ops without tuning: the tuner's gain, default time / tuned time; from the CUDA-graph pair when both
    # were run, since at short sequences the eager calls are host-bound and scatter more than the tuner gains.
    pair = next((pr for pr in (("m2ops-default-graph", "m2ops-graph"), ("m2ops-default", "m2ops"))
                 if all(p in peers for p in pr)), None)
    head = (["T", "N"] + [f"{p} ms (× floor)" for p in peers] + [_speedup_head(p) for p in others]
            + (["default / tuned"] if pair else [])
            + ["floor ms"] + (["m2ops error y / final"] if checked else [])
            + (["m2ops largest gradient error"] if grads_checked else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in sorted(by_shape.items(), key=lambda kv: (shapes[kv[0]]["shape"]["seqlen"],
                                                             shapes[kv[0]]["shape"]["dstate"])):
        s = shapes[key]
        ours = row.get("m2ops")
        floor = s["floor_ms"]
        cells = [_t(s["shape"]["seqlen"]), str(s["shape"]["dstate"])] + [_fmt_ms(row.get(p), floor) for p in peers]
        cells += [_ratio(row.get(p), row.get(ours_for(p))) for p in others]
        if pair:
            cells.append(_ratio(row.get(pair[0]), row.get(pair[1])))
        cells.append(f"{floor:.3g}")
        if checked:
            cells.append(f"{ours['err_y']:.1e} / {ours['err_final']:.1e}" if ours and "err_y" in ours else "")
        if grads_checked:
            worst = max(ours["err_grads"], key=ours["err_grads"].get) if ours and "err_grads" in ours else None
            cells.append(f"{ours['err_grad_max']:.1e} ({worst})" if worst else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _t(seqlen):
    return f"{seqlen // 1024}K" if seqlen % 1024 == 0 else str(seqlen)


def kernels_markdown(results: list[dict], peers: list[str], top: int = 6) -> str:
    """Where each peer's time goes at each point (--kernels): one row per (shape, peer) with its `top` largest
    kernels, ms per call, largest first; "" when no result has a profile."""
    rows = [r for r in results if r.get("kernel_ms")]
    if not rows:
        return ""
    order = {p: i for i, p in enumerate(peers)}
    rows.sort(key=lambda r: (r["shape"]["seqlen"], r["shape"]["dstate"], order.get(r["peer"], len(order))))
    lines = ["| T | N | peer | ms | largest kernels, ms per call |", "|---|---|---|---|---|"]
    for r in rows:
        named = [(k, v) for k, v in r["kernel_ms"].items() if k != "(others)"][:top]
        text = ", ".join(f"{k.replace('|', '/')} {v:.3f}" for k, v in named)
        lines.append(f"| {_t(r['shape']['seqlen'])} | {r['shape']['dstate']} | {r['peer']} | {r['ms']:.3f} | {text} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str):
    """Speedup of m2ops over each peer against sequence length (ours_for), one line per dstate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = {(r["peer"], r["key"]): r for r in results if r["peer"] in ("m2ops", "m2ops-graph") and "ms" in r}
    others = sorted({r["peer"] for r in results if not r["peer"].startswith("m2ops")})
    if not others:
        return
    cols = min(4, len(others))
    rows = -(-len(others) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(others):]:
        ax.set_visible(False)
    for ax, peer in zip(axes.flat, others):
        lines = defaultdict(list)
        for r in results:
            mine = ours.get((ours_for(peer), r["key"]))
            if r["peer"] == peer and "ms" in r and mine:
                lines[r["shape"]["dstate"]].append((r["shape"]["seqlen"], r["ms"] / mine["ms"]))
        for n, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"dstate {n}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ours_for(peer)} speedup over {peer}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("× (peer time / m2ops time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
