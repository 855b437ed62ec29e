"""python -m m2ops.bench.model: a transformers Mamba2ForCausalLM without and with m2ops.

Builds a randomly initialised Mamba2ForCausalLM at a realistic width (defaults: d_model 2560, 4 layers of 80
heads of 64, d_state 128, one group, chunk 256, vocabulary 50280; bfloat16 on CUDA) and times, for each
implementation,

  forward   one forward over a prompt of --seqlen tokens (batch --batch), as generate()'s prefill runs it:
            with a cache, logits of the last token only (--all-logits: of every token);
  generate  model.generate() of --new-tokens tokens after a prompt of --gen-prompt tokens, greedy, with the
            cache; generate() of one token is timed as well, so that
            decode ms/token = (generate(N) - generate(1)) / (N - 1) leaves the prompt out.

Implementations: "transformers" is the model as transformers runs it (no m2ops): its mamba_ssm /
causal_conv1d kernels where those packages are importable, else its PyTorch fallback. Which one it is, is
read from the functions transformers bound at import (use_kernel_func_from_hub_with_fallback) and checked by
profiling one run: the JSON lists the kernel and op names seen. "m2ops" is the same model after
m2ops.integrations.transformers.patch() (unpatched again at the end).

Timing: CUDA events around each call (torch.cuda.synchronize after), warm-up runs excluded, median of --runs
(every run is in the JSON); on the CPU perf_counter. Prints a markdown table; --out writes JSON.

--smoke: a tiny model and a few runs, on the CPU where there is no GPU (what the CPU test suite runs).

--family NAME|all: instead, every transformers family with Mamba-2 mixers at a published checkpoint's sizes
(model_family.py; its options: python -m m2ops.bench.model --family all --help).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import sys

import torch

from .check import rel_err
from .report import publish
from .timing import runs_ms, summary

MODULE = "transformers.models.mamba2.modeling_mamba2"
IMPLS = ("transformers", "m2ops")
# the module-level functions of modeling_mamba2 that Mamba2Mixer.forward calls, and what each does
FUNCTIONS = {
    "mamba2_chunk_scan": "scan (prompt)",
    "mamba2_selective_state_update": "decode step",
    "causal_conv1d_fn": "conv (prompt)",
    "causal_conv1d_update": "conv (decode step)",
    "mamba2_split_conv1d_scan_combined": "fused training path",
}
# substrings of profiler event names that tell which Mamba-2 implementation ran
PROFILE_KEYS = ("m2ops::", "mamba", "chunk_scan", "chunk_state", "state_passing", "chunk_cumsum", "bmm_chunk",
                "selective", "state_update", "causal_conv1d", "ssd")

SMOKE = dict(d_model=64, n_layers=2, headdim=16, d_state=16, expand=2, ngroups=1, chunk_size=16, vocab=256,
             batch=1, seqlen=40, new_tokens=4, gen_prompt=12, runs=2, warmup=1)


def resolve_device(p, args, smoke_what: str):
    """args.device (default: cuda where torch sees a GPU, else the CPU with --smoke, else an error naming --smoke)
    and args.dtype (default: bfloat16 on CUDA, float32 on the CPU); p.error for a CUDA device torch does not see."""
    if args.device is None:
        if torch.cuda.is_available():
            args.device = "cuda"
        elif args.smoke:
            args.device = "cpu"
        else:
            p.error(f"no CUDA GPU: use --smoke ({smoke_what} on the CPU) or --device cpu")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA GPU")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m m2ops.bench.model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=2560)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--d-state", type=int, default=128)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=4096, help="prompt length of the forward timing")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generate() produces")
    p.add_argument("--gen-prompt", type=int, default=None, help="prompt length for generate() (default: --seqlen)")
    p.add_argument("--all-logits", action="store_true", help="forward computes the logits of every token")
    p.add_argument("--modes", default="forward,generate", help="comma-separated: forward, generate")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from: {', '.join(IMPLS)}")
    p.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (cuTile JIT compiles here)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="cuda (default) or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled runs that show which kernels ran")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, few runs (sizes below are then ignored); CPU when there is no GPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--family", default=None,
                   help="per-family benchmark instead (its own options: --family all --help)")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    resolve_device(p, args, "a tiny model")
    if args.gen_prompt is None:
        args.gen_prompt = args.seqlen
    args.modes = [m for m in args.modes.split(",") if m]
    args.impls = [m for m in args.impls.split(",") if m]
    for m in args.modes:
        if m not in ("forward", "generate"):
            p.error(f"--modes: unknown mode {m!r}")
    for m in args.impls:
        if m not in IMPLS:
            p.error(f"--impls: unknown implementation {m!r}")
    if (args.d_model * args.expand) % args.headdim:
        p.error("--headdim must divide d_model * expand")
    if (args.d_model * args.expand // args.headdim) % args.ngroups:
        p.error("--ngroups must divide the number of heads")
    if min(args.runs, args.new_tokens, args.seqlen, args.gen_prompt, args.batch) < 1 or args.warmup < 0:
        p.error("--runs, --new-tokens, --seqlen, --gen-prompt and --batch must be positive")
    return args


# ---------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------

def build_model(args, device, dtype):
    import transformers
    nheads = args.d_model * args.expand // args.headdim
    config = transformers.Mamba2Config(
        vocab_size=args.vocab, hidden_size=args.d_model, num_heads=nheads, head_dim=args.headdim,
        state_size=args.d_state, n_groups=args.ngroups, expand=args.expand, conv_kernel=4,
        num_hidden_layers=args.n_layers, chunk_size=args.chunk_size, pad_token_id=0, bos_token_id=1,
        eos_token_id=None)  # no EOS: generate() always makes --new-tokens tokens
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device (a 2560-wide model initialises slowly on the CPU)
        model = transformers.Mamba2ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval(), config


# ---------------------------------------------------------------------------------------------------------
# which implementation transformers runs
# ---------------------------------------------------------------------------------------------------------

def _describe(fn, mod):
    """Where a modeling_mamba2 function's work is done: "m2ops", "transformers PyTorch fallback", or the
    module.name of the package function transformers bound instead (mamba_ssm, causal_conv1d, ...).

    transformers 5.x wraps each function in use_kernel_func_from_hub_with_fallback, whose closure holds the
    bound `implementation` and the `torch_function` fallback; a hub-kernel wrapper around it is followed through
    __wrapped__."""
    if fn is None:
        return "absent"
    if getattr(fn, "__module__", "").startswith("m2ops"):
        return "m2ops"
    f, seen = fn, set()
    while f is not None and id(f) not in seen:
        seen.add(id(f))
        try:
            bound = inspect.getclosurevars(f).nonlocals
        except (TypeError, ValueError):
            bound = {}
        if "implementation" in bound:
            impl = bound["implementation"]
            if impl is bound.get("torch_function") or getattr(impl, "__module__", None) == mod.__name__:
                return "transformers PyTorch fallback"
            return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"
        f = getattr(f, "__wrapped__", None)
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if getattr(fn, "__module__", None) == mod.__name__:
        return f"transformers PyTorch fallback (assumed: {where} has no kernel wrapper)"
    return f"unknown ({where})"


def transformers_path(module=MODULE):
    """What the mixer of transformers' module (default: Mamba2's) calls now (before patch(): transformers' own
    choice)."""
    mod = importlib.import_module(module)
    funcs = {name: _describe(getattr(mod, name, None), mod) for name in FUNCTIONS}
    info = {"functions": funcs}
    try:
        from transformers.utils import import_utils as iu
        for name in ("is_mamba_2_ssm_available", "is_causal_conv1d_available", "is_kernels_available"):
            if hasattr(iu, name):
                info[name] = bool(getattr(iu, name)())
    except Exception as e:  # noqa: BLE001 - informative only
        info["availability_error"] = repr(e)
    parts = []
    for name in ("mamba2_chunk_scan", "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        where = funcs[name]
        short = ("PyTorch" if where.startswith("transformers PyTorch fallback")
                 else where if where in ("m2ops", "absent") or where.startswith("unknown")
                 else where.split(".")[0])
        parts.append(f"{FUNCTIONS[name]}: {short}")
    info["summary"] = "; ".join(parts)
    return info


def m2ops_backend(device):
    if device.type != "cuda":
        return "PyTorch reference (CPU)"
    from ..ops import dispatch
    reason = dispatch._reason_for_reference(device.index if device.index is not None else 0)
    return "cuTile kernels" if reason is None else f"PyTorch reference on CUDA ({reason})"


def profiled_names(fn, device):
    """Names of the profiler events (ops and, on CUDA, kernels) of one call of fn that belong to a Mamba-2
    implementation (PROFILE_KEYS), with their counts."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    counts = {}
    for e in prof.events():
        low = e.name.lower()
        if any(k in low for k in PROFILE_KEYS):
            counts[e.name] = counts.get(e.name, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------

def _peak_mib(device, fn):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2 ** 20


def run_impl(model, args, device, prompt, gen_prompt):
    """Times of one implementation (whatever transformers' functions are now), plus what the checks
    compare: the last token's logits of the forward and the generated tokens."""
    res = {}
    keep = 0 if args.all_logits else 1

    def forward():
        return model(prompt, use_cache=True, logits_to_keep=keep).logits

    def gen(n):
        return model.generate(gen_prompt, attention_mask=torch.ones_like(gen_prompt), max_new_tokens=n,
                              do_sample=False, use_cache=True)

    with torch.no_grad():
        if "forward" in args.modes:
            t = summary(runs_ms(forward, device, args.runs, args.warmup))
            t["tokens_per_s"] = args.batch * args.seqlen / (t["median_ms"] / 1e3)
            t["peak_mib"] = _peak_mib(device, forward)
            res["forward"] = t
            res["last_logits"] = forward()[:, -1].float().cpu()
        if "generate" in args.modes:
            t = summary(runs_ms(lambda: gen(args.new_tokens), device, args.runs, args.warmup))
            t1 = summary(runs_ms(lambda: gen(1), device, args.runs, args.warmup))
            t["generate_1_median_ms"] = t1["median_ms"]
            t["generate_1_runs_ms"] = t1["runs_ms"]
            t["decode_ms_per_token"] = ((t["median_ms"] - t1["median_ms"]) / (args.new_tokens - 1)
                                        if args.new_tokens > 1 else None)
            t["peak_mib"] = _peak_mib(device, lambda: gen(args.new_tokens))
            res["generate"] = t
            res["tokens"] = gen(args.new_tokens)[:, gen_prompt.shape[1]:].cpu()
        if not args.no_profile:
            try:
                names = {}
                if "forward" in args.modes:
                    names["forward"] = profiled_names(forward, device)
                if "generate" in args.modes:
                    names["generate"] = profiled_names(lambda: gen(min(args.new_tokens, 3)), device)
                res["profiled"] = names
            except Exception as e:  # noqa: BLE001 - the profiler is informative, not the measurement
                res["profiled"] = {"error": repr(e)}
    return res


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def _fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(result):
    cfg, res = result["config"], result["results"]
    impls = [i for i in IMPLS if i in res]
    head = "| | " + " | ".join(impls) + (" | speedup |" if len(impls) == 2 else " |")
    lines = [head, "|---" * (len(impls) + 1 + (len(impls) == 2)) + "|"]

    def row(label, mode, key, digits=2, speedup=True):
        vals = [res[i].get(mode, {}).get(key) for i in impls]
        if all(v is None for v in vals):
            return
        line = f"| {label} | " + " | ".join(_fmt(v, digits) for v in vals)
        if len(impls) == 2:
            ok = speedup and None not in vals and vals[1] > 0
            line += " | " + (f"{vals[0] / vals[1]:.2f}x" if ok else "-")
        lines.append(line + " |")

    T, N, P = cfg["seqlen"], cfg["new_tokens"], cfg["gen_prompt"]
    row(f"forward, {cfg['batch']} x {T} tokens (ms)", "forward", "median_ms")
    row("forward peak memory (MiB)", "forward", "peak_mib", 0, speedup=False)
    row(f"generate {N} tokens after {P} (ms)", "generate", "median_ms")
    row(f"generate 1 token after {P} (ms)", "generate", "generate_1_median_ms")
    row("decode (ms/token)", "generate", "decode_ms_per_token", 3)
    title = (f"Mamba2ForCausalLM d_model={cfg['d_model']} layers={cfg['n_layers']} heads={cfg['nheads']}x"
             f"{cfg['headdim']} d_state={cfg['d_state']} ngroups={cfg['ngroups']} chunk={cfg['chunk_size']} "
             f"vocab={cfg['vocab']} {cfg['dtype']} on {result['env']['device_name']}; median of {cfg['runs']} "
             f"runs after {cfg['warmup']} warm-up")
    checks = result.get("checks", {})
    notes = [f"transformers: {result['transformers_path']['summary']}",
             f"m2ops: {result['env']['m2ops_backend']} (after m2ops.integrations.transformers.patch())"]
    if "last_logits_rel_diff" in checks:
        notes.append(f"last-token logits, m2ops vs transformers: normwise relative difference "
                     f"{checks['last_logits_rel_diff']:.2e}")
    if "same_greedy_tokens" in checks:
        notes.append(f"same greedy tokens: {checks['same_greedy_tokens']}")
    return "\n".join([title, "", *lines, "", *(f"- {n}" for n in notes)]) + "\n"


def _wants_family(argv):
    return any(a == "--family" or a.startswith("--family=") for a in argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if _wants_family(argv):  # its own options and defaults (prompt lengths, batches, runs): its own parser
        from .model_family import main as family_main
        return family_main(argv)
    args = parse_args(argv)
    import transformers

    import m2ops.integrations.transformers as m2tf

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    model, config = build_model(args, device, dtype)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, args.vocab, (args.batch, args.seqlen), generator=gen).to(device)
    gen_prompt = torch.randint(3, args.vocab, (args.batch, args.gen_prompt), generator=gen).to(device)

    m2tf.unpatch()
    path = transformers_path()
    result = {
        "config": {**{k: getattr(args, k) for k in ("d_model", "n_layers", "headdim", "d_state", "expand",
                                                    "ngroups", "chunk_size", "vocab", "batch", "seqlen",
                                                    "new_tokens", "gen_prompt", "all_logits", "runs", "warmup",
                                                    "dtype", "seed", "smoke", "modes", "impls")},
                   "nheads": config.num_heads, "device": str(device),
                   "params": sum(p.numel() for p in model.parameters())},
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(),
                "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                else f"CPU ({platform.processor() or platform.machine()})"),
                "m2ops_backend": m2ops_backend(device)},
        "transformers_path": path,
        "results": {},
    }
    extra = {}
    try:
        for impl in args.impls:
            if impl == "m2ops":
                m2tf.patch()
            else:
                m2tf.unpatch()
            r = run_impl(model, args, device, prompt, gen_prompt)
            extra[impl] = {k: r.pop(k) for k in ("last_logits", "tokens") if k in r}
            result["results"][impl] = r
            print(f"{impl}: done", file=sys.stderr, flush=True)
    finally:
        m2tf.unpatch()

    checks = {}
    if len(extra) == 2:
        a, b = extra["m2ops"], extra["transformers"]
        if "last_logits" in a and "last_logits" in b:
            checks["last_logits_rel_diff"] = rel_err(a["last_logits"], b["last_logits"])
        if "tokens" in a and "tokens" in b:
            checks["same_greedy_tokens"] = bool(torch.equal(a["tokens"], b["tokens"]))
            # bfloat16 rounding may flip a near-tie; from there on the texts differ
            same = (a["tokens"] == b["tokens"]).all(0).long()
            checks["greedy_tokens_agreeing_prefix"] = int(same.cumprod(0).sum().item())
    result["checks"] = checks
    return publish(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
