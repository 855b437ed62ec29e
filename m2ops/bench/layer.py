"""python -m m2ops.bench.layer: one Mamba-2 layer, m2ops.Mamba2 against mamba_ssm's Mamba2 on the same weights.

Both layers load one state dict (m2ops.Mamba2 keeps mamba_ssm's parameter names and shapes) and run on the same
inputs. Implementations (--impls):

  m2ops              m2ops.Mamba2 (training through its memory-efficient path, use_mem_eff_path=True)
  m2ops-plain        m2ops.Mamba2(use_mem_eff_path=False): every op keeps what its own backward needs
  mamba_ssm          mamba_ssm.modules.mamba2.Mamba2 on its plain path (use_mem_eff_path=False): its Triton scan
                     and gated norm, and for the convolution causal-conv1d where importable, else nn.Conv1d
  mamba_ssm-memeff   the same on its memory-efficient path (use_mem_eff_path=True: one autograd function that
                     recomputes the convolution in backward); needs causal-conv1d, skipped without it

Modes (--modes), at each batch x seqlen of --shapes:

  forward   out = layer(u), no gradients
  train     forward, then the gradients of every parameter and of u (torch.autograd.grad); also the peak memory
            the step adds above what was allocated before it
  decode    one token, at each batch of --decode-batches: step(u, conv_state, ssm_state) captured in a CUDA graph
            and replayed (the time per replay), and the host time of an eager step (the time to issue 50 steps,
            without synchronising, divided by 50)

Timing: CUDA events around each run (synchronised before and after), warm-up runs first, the median of --runs.
Each implementation's output (and in train mode its input gradient) is compared with m2ops.Mamba2 in float32 on
the same weights and input: the JSON holds the normwise relative errors. --smoke: a tiny layer on the CPU where
there is no GPU (m2ops only when mamba_ssm is not importable), what the CPU tests run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from .check import rel_err
from .report import publish
from .timing import graphed, runs_ms, summary

IMPLS = ("m2ops", "m2ops-plain", "mamba_ssm", "mamba_ssm-memeff")
MODES = ("forward", "train", "decode")
SMOKE = dict(d_model=32, d_state=16, headdim=8, shapes="2x40", decode_batches="1,3", runs=2, warmup=1,
             chunk_size=16)


def _shape(text):
    try:
        b, t = text.lower().split("x")
        b, t = int(b), int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQLEN such as 8x4K; got {text!r}") from None
    if b < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"batch and seqlen must be positive; got {text!r}")
    return b, t


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m m2ops.bench.layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x4K,1x64K", help="comma-separated BATCHxSEQLEN (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=2560, help="(default: %(default)s)")
    p.add_argument("--d-state", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--headdim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--ngroups", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--expand", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, from: %(default)s")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: %(default)s")
    p.add_argument("--decode-batches", default="1,64,256", help="batches of the decode step (default: %(default)s)")
    p.add_argument("--state-dtype", default="dtype", choices=["dtype", "float32"],
                   help="the decode caches' ssm_state dtype for both layers: the layer's dtype (mamba_ssm's "
                        "default) or float32 (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--runs", type=int, default=10, help="timed runs, median reported (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes where not given; on the CPU where there is no GPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:  # tiny sizes, where not given
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    try:
        args.shapes = [_shape(s) for s in args.shapes.split(",") if s]
        args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"argument --shapes/--decode-batches: {e}")
    if any(b < 1 for b in args.decode_batches):
        p.error("argument --decode-batches: expected positive integers")
    args.impls = [i for i in args.impls.split(",") if i]
    args.modes = [m for m in args.modes.split(",") if m]
    for i in args.impls:
        if i not in IMPLS:
            p.error(f"argument --impls: unknown implementation {i!r} (choose from {', '.join(IMPLS)})")
    for m in args.modes:
        if m not in MODES:
            p.error(f"argument --modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    for name in ("d_model", "d_state", "headdim", "ngroups", "expand", "chunk_size", "runs"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: expected a positive integer")
    if args.warmup < 0:
        p.error("argument --warmup: expected a non-negative integer")
    if (args.d_model * args.expand) % args.headdim or (args.d_model * args.expand // args.headdim) % args.ngroups:
        p.error("--headdim must divide d_model * expand, and --ngroups the number of heads")
    args.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if args.device is None:
        if not args.smoke:
            p.error("no CUDA GPU: use --smoke (a tiny layer on the CPU)")
        args.device = torch.device("cpu")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    return args


# ---------------------------------------------------------------------------------------------------------
# the layers
# ---------------------------------------------------------------------------------------------------------

def layer_kwargs(args) -> dict:
    return dict(d_model=args.d_model, d_state=args.d_state, d_conv=4, expand=args.expand, headdim=args.headdim,
                ngroups=args.ngroups, chunk_size=args.chunk_size, rmsnorm=True, norm_before_gate=False)


def peer_status(impl: str):
    """None when impl can run here, else why not."""
    if impl.startswith("m2ops"):
        return None
    try:
        import mamba_ssm.modules.mamba2 as peer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the peer does not run here
        return f"mamba_ssm is not importable ({type(e).__name__}: {e})"
    if impl == "mamba_ssm-memeff" and peer.causal_conv1d_fn is None:
        return "causal-conv1d is not importable (the memory-efficient path needs it)"
    return None


def build(impl: str, args, state_dict, device, dtype):
    if impl in ("m2ops", "m2ops-plain"):
        from ..layer import Mamba2
        layer = Mamba2(**layer_kwargs(args), use_mem_eff_path=impl == "m2ops", device=device, dtype=dtype)
    else:
        from mamba_ssm.modules.mamba2 import Mamba2
        layer = Mamba2(**layer_kwargs(args), use_mem_eff_path=impl == "mamba_ssm-memeff", device=device,
                       dtype=dtype)
    layer.load_state_dict(state_dict)
    return layer


def conv_path(impl: str) -> str:
    if impl.startswith("m2ops"):
        return "m2ops"
    import mamba_ssm.modules.mamba2 as peer
    return "causal-conv1d" if peer.causal_conv1d_fn is not None else "nn.Conv1d"


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------

def peak_mib(device, fn):
    """MiB fn allocates at its peak above what was allocated before it (CUDA), else None."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def run_prompt(layer, args, u, g_out, modes) -> dict:
    """forward and train times (and outputs for the checks) of one layer at one shape."""
    res, dev = {}, u.device
    params = [p for p in layer.parameters() if p.requires_grad]
    if "forward" in modes:
        with torch.no_grad():
            res["forward"] = summary(runs_ms(lambda: layer(u), dev, args.runs, args.warmup))
            res["forward"]["peak_mib"] = peak_mib(dev, lambda: layer(u))
            res["out"] = layer(u).float()
    if "train" in modes:
        ug = u.detach().requires_grad_(True)

        def step():
            return torch.autograd.grad(layer(ug), [ug, *params], g_out)

        res["train"] = summary(runs_ms(step, dev, args.runs, args.warmup))
        res["train"]["peak_mib"] = peak_mib(dev, step)
        res["grad_u"] = step()[0].float()
    return res


def run_decode(layer, args, batch, dtype, device) -> dict:
    """The decode step at one batch: graph-replayed time, eager host time."""
    gen = torch.Generator(device="cpu").manual_seed(args.seed + batch)
    h = torch.randn(batch, 1, args.d_model, generator=gen).to(device, dtype)
    conv, ssm = layer.allocate_inference_cache(batch, 1, dtype=dtype)
    ssm = ssm.float() if args.state_dtype == "float32" else ssm.to(dtype)
    conv.copy_(torch.randn(conv.shape, generator=gen).to(conv))
    ssm.copy_(torch.randn(ssm.shape, generator=gen).to(ssm) * 0.1)

    def step():
        return layer.step(h, conv, ssm)[0]

    res = {"ssm_state_dtype": str(ssm.dtype).replace("torch.", "")}
    with torch.no_grad():
        if device.type == "cuda":
            replay = graphed(step)
            reps = 100
            times = runs_ms(lambda: [replay() for _ in range(reps)], device, args.runs, args.warmup)
            res["graph_us"] = 1e3 * statistics.median(times) / reps
            n = 50
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            res["eager_host_us"] = 1e6 * (time.perf_counter() - t0) / n
            torch.cuda.synchronize(device)
        else:
            res["eager_us"] = 1e3 * statistics.median(runs_ms(step, device, args.runs, args.warmup))
    return res


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def markdown(result) -> str:
    res, cfg = result["results"], result["config"]
    impls = [i for i in IMPLS if i in res and "skipped" not in res[i]]
    lines = [f"Mamba-2 layer d_model={cfg['d_model']} d_state={cfg['d_state']} headdim={cfg['headdim']} "
             f"ngroups={cfg['ngroups']} chunk={cfg['chunk_size']} {cfg['dtype']} on {result['env']['device']}; "
             f"median of {cfg['runs']} runs", ""]
    head = "| | " + " | ".join(impls + [f"m2ops vs {i}" for i in impls if i != "m2ops" and "m2ops" in impls]) + " |"
    lines += [head, "|---" * (head.count("|") - 1) + "|"]

    def row(label, get, speed=True, digits=3):
        vals = [get(res[i]) for i in impls]
        if all(v is None for v in vals):
            return
        cells = ["-" if v is None else f"{v:.{digits}f}" for v in vals]
        ratios = []
        if "m2ops" in impls:
            mine = vals[impls.index("m2ops")]
            for i, v in zip(impls, vals):
                if i != "m2ops":
                    ok = speed and mine and v
                    ratios.append(f"{v / mine:.2f}x" if ok else "-")
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")

    for b, t in cfg["shapes"]:
        key = f"{b}x{t}"
        for mode in ("forward", "train"):
            row(f"{mode} {key} (ms)", lambda r, k=key, m=mode: r.get(k, {}).get(m, {}).get("median_ms"))
            row(f"{mode} {key} peak (MiB)", lambda r, k=key, m=mode: r.get(k, {}).get(m, {}).get("peak_mib"),
                speed=False, digits=0)
    for b in cfg["decode_batches"]:
        row(f"decode batch {b}, graph (us)", lambda r, b=b: r.get(f"decode{b}", {}).get("graph_us"), digits=1)
        row(f"decode batch {b}, eager host (us)", lambda r, b=b: r.get(f"decode{b}", {}).get("eager_host_us"),
            speed=False, digits=1)
        row(f"decode batch {b}, eager (us)", lambda r, b=b: r.get(f"decode{b}", {}).get("eager_us"), digits=1)
    skipped = [f"{i}: {res[i]['skipped']}" for i in res if "skipped" in res[i]]
    notes = [f"{i}: convolution {res[i]['conv']}" for i in impls] + skipped
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv=None):
    args = parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    from ..layer import Mamba2
    source = Mamba2(**layer_kwargs(args), device=device, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    result = {"config": {**{k: getattr(args, k) for k in ("d_model", "d_state", "headdim", "ngroups", "expand",
                                                           "chunk_size", "shapes", "decode_batches", "impls",
                                                           "modes", "state_dtype", "dtype", "runs", "warmup",
                                                           "seed", "smoke")}},
              "env": {"torch": torch.__version__, "python": platform.python_version(),
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"},
              "results": {}}
    wanted = {}
    for b, t in args.shapes:  # float32 m2ops on the same weights: what every output is compared with
        gen = torch.Generator().manual_seed(args.seed + t)
        u = torch.randn(b, t, args.d_model, generator=gen)
        g = torch.randn(b, t, args.d_model, generator=gen)
        want = run_prompt(source, argparse.Namespace(runs=1, warmup=0), u.to(device), g.to(device),
                          [m for m in args.modes if m != "decode"]) if set(args.modes) - {"decode"} else {}
        wanted[(b, t)] = (u, g, want)
    del source
    for impl in args.impls:
        why = peer_status(impl)
        if why is not None:
            result["results"][impl] = {"skipped": why}
            print(f"{impl}: skipped: {why}", file=sys.stderr, flush=True)
            continue
        layer = build(impl, args, state, device, dtype)
        r = result["results"][impl] = {"conv": conv_path(impl)}
        for (b, t), (u, g, want) in wanted.items():
            got = run_prompt(layer, args, u.to(device, dtype), g.to(device, dtype),
                             [m for m in args.modes if m != "decode"])
            entry = {k: v for k, v in got.items() if k in ("forward", "train")}
            if "out" in got:
                entry["out_rel_err"] = rel_err(got["out"], want["out"])
            if "grad_u" in got:
                entry["grad_u_rel_err"] = rel_err(got["grad_u"], want["grad_u"])
            r[f"{b}x{t}"] = entry
        if "decode" in args.modes:
            for b in args.decode_batches:
                r[f"decode{b}"] = run_decode(layer, args, b, dtype, device)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{impl}: done", file=sys.stderr, flush=True)
    return publish(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
