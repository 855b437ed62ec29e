"""python -m m2ops.bench.model --family NAME|all: model speed per transformers family, without and with m2ops.

For each family (m2ops/bench/families.py: the checkpoint its sizes come from, the layers kept) a randomly
initialised <Family>ForCausalLM at the checkpoint's sizes, --n-layers deep (default 4), bfloat16 on CUDA, timed as

  prefill  one forward over a prompt of each --seqlen (batch 1) as generate()'s prefill runs it: with the cache,
           logits of the last token only;
  decode   ms per generated token at each --batch: (generate(N) - generate(1)) / (N - 1), greedy, after a prompt of
           --decode-prompt tokens, so the prompt cancels out.

Decode modes (--decode): "graphs" passes generate() a transformers StaticCache, reset and reused by every call
(its tensors keep their addresses), so that on CUDA generate() compiles the one-token step with its default
CompileConfig (torch.compile, mode "reduce-overhead": CUDA graphs); where that fails for a family or an
implementation, the error is kept and that decode runs "eager" instead, which is generate()'s default (a
DynamicCache, no compilation). On the CPU "graphs" runs the StaticCache uncompiled (generate() compiles on
accelerators only). The JSON keeps each decode's mode, the error if any, the first call's time (where the
compilation happens) and torch's counts of graphs compiled, graph breaks and CUDA graphs skipped in it.

Implementations, each on the same model, weights and prompts: "transformers" (its mamba_ssm / causal_conv1d kernels
where importable, else its PyTorch fallback: which one is read from the functions transformers bound and checked by
profiling) and "m2ops" (after m2ops.integrations.transformers.patch(families=[NAME]), unpatched at the end). The
last-token logits of each prefill are compared: max |m2ops - transformers| / max |transformers|.

--family all runs every family in turn, printing each one's table as soon as it is done and rewriting --out after
each, so that a run cut short keeps what it measured. --smoke: tiny sizes, CPU where there is no GPU (the tests).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import platform
import sys
import time

import torch

from . import families
from .check import rel_err
from .model import IMPLS, m2ops_backend, profiled_names, resolve_device, transformers_path
from .report import save_json
from .timing import runs_ms, summary

PROG = "python -m m2ops.bench.model"
SMOKE = dict(seqlen="40,72", batch="1,3", decode_prompt=12, new_tokens=4, runs=1, warmup=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=f"{PROG} --family", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, help=f"all, or comma-separated from: {', '.join(families.names())}")
    p.add_argument("--n-layers", type=int, default=4, help="layers of the checkpoint's pattern kept (see above)")
    p.add_argument("--seqlen", default="4096,32768", help="comma-separated prompt lengths of the prefill timing")
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes of the decode timing")
    p.add_argument("--decode-prompt", type=int, default=128, help="prompt length before the decode timing")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generate() makes in the decode timing")
    p.add_argument("--decode", default="graphs", choices=["graphs", "eager"], help="decode mode (see above)")
    p.add_argument("--modes", default="prefill,decode", help="comma-separated: prefill, decode")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from: {', '.join(IMPLS)}")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the checkpoint's)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (cuTile JIT compiles here)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="cuda (default) or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled runs that show which kernels ran")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and few runs; CPU when there is no GPU")
    p.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each family)")
    args = p.parse_args(argv)
    known = families.names()
    args.families = known if args.family == "all" else [f for f in args.family.split(",") if f]
    unknown = [f for f in args.families if f not in known]
    if unknown or not args.families:
        # one line, naming what is known (argparse would add its usage)
        sys.exit(f"{PROG}: --family: unknown family {', '.join(map(repr, unknown)) or repr(args.family)}; "
                 f"known: all, {', '.join(known)}")
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    resolve_device(p, args, "tiny models")
    for name, plural in (("seqlen", "seqlens"), ("batch", "batches")):
        try:
            values = [int(v) for v in getattr(args, name).split(",") if v]
        except ValueError:
            p.error(f"--{name}: comma-separated integers, got {getattr(args, name)!r}")
        if not values or min(values) < 1:
            p.error(f"--{name}: positive integers, got {getattr(args, name)!r}")
        setattr(args, plural, values)
    args.modes = [m for m in args.modes.split(",") if m]
    args.impls = [m for m in args.impls.split(",") if m]
    for m in args.modes:
        if m not in ("prefill", "decode"):
            p.error(f"--modes: unknown mode {m!r} (prefill, decode)")
    for m in args.impls:
        if m not in IMPLS:
            p.error(f"--impls: unknown implementation {m!r} ({', '.join(IMPLS)})")
    if min(args.runs, args.decode_prompt, args.n_layers) < 1 or args.new_tokens < 2 or args.warmup < 0:
        p.error("--runs, --decode-prompt and --n-layers must be positive, --new-tokens at least 2")
    return args


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device):
    import transformers

    import m2ops
    return {"device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"CPU ({platform.processor() or platform.machine()})"),
            "torch": torch.__version__, "transformers": transformers.__version__, "m2ops": m2ops.__version__,
            "mamba_ssm": _version("mamba_ssm") or _version("mamba-ssm"),
            "causal_conv1d": _version("causal_conv1d") or _version("causal-conv1d"),
            "python": platform.python_version(), "m2ops_backend": m2ops_backend(device)}


# ---------------------------------------------------------------------------------------------------------
# measurements of one implementation (whatever the family's module functions are now)
# ---------------------------------------------------------------------------------------------------------

def _guarded(fn, device):
    """fn()'s result, or {"error": ...} (out of memory, or a family that cannot run this): the other measurements
    and families go on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
        if device.type == "cuda":
            torch.cuda.empty_cache()
        why = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"
        print(f"  error: {why.splitlines()[0][:300]}", file=sys.stderr, flush=True)
        return {"error": why.splitlines()[0][:500]}


def prefill(model, prompt, args, device):
    def forward():
        return model(prompt, use_cache=True, logits_to_keep=1).logits

    t = summary(runs_ms(forward, device, args.runs, args.warmup))
    t["tokens_per_s"] = prompt.numel() / (t["median_ms"] / 1e3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t["last_logits"] = forward()[:, -1].float().cpu()
    t["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
    return t


def _generator(model, prompt, static, max_new):
    """generate(k <= max_new) after prompt: greedy, with a StaticCache reused across calls (static; reset before
    each) or generate()'s own cache."""
    mask = torch.ones_like(prompt)
    cache = None
    if static:
        from transformers import StaticCache
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + max_new)

    def gen(k):
        extra = {}
        if cache is not None:
            cache.reset()
            extra["cache"] = cache
        return model.generate(prompt, attention_mask=mask, max_new_tokens=k, do_sample=False, use_cache=True,
                              **extra)
    return gen


def _decode_once(model, prompt, args, device, static):
    """Decode timing; with the count of graphs torch.compile made (0: generate() ran the step uncompiled), of graph
    breaks and of CUDA graphs skipped during the first call (where the compilation happens)."""
    from torch._dynamo.utils import counters

    def counts():
        return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                counters["inductor"]["cudagraph_skips"])
    n = args.new_tokens
    gen = _generator(model, prompt, static, n)
    before, t0 = counts(), time.perf_counter()
    gen(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    compiled = dict(zip(("compiled_graphs", "graph_breaks", "cudagraph_skips"),
                        (b - a for a, b in zip(before, counts()))))
    t = summary(runs_ms(lambda: gen(n), device, args.runs, args.warmup))
    t1 = summary(runs_ms(lambda: gen(1), device, args.runs, args.warmup))
    t.update(generate_1_median_ms=t1["median_ms"], generate_1_runs_ms=t1["runs_ms"], first_call_s=first_s,
             ms_per_token=(t["median_ms"] - t1["median_ms"]) / (n - 1), **compiled)
    return t


def decode(model, prompt, args, device):
    """Decode timing in args.decode's mode; a "graphs" decode that fails is timed again "eager", keeping why."""
    graphs_error = None
    if args.decode == "graphs":
        try:
            t = _decode_once(model, prompt, args, device, static=True)
            if device.type != "cuda":
                t["mode"] = "StaticCache, eager (generate() compiles on accelerators only)"
            elif t["compiled_graphs"] and not t["cudagraph_skips"]:
                t["mode"] = "CUDA graphs (StaticCache, torch.compile reduce-overhead)"
            elif t["compiled_graphs"]:
                t["mode"] = "StaticCache, torch.compile, some CUDA graphs skipped (torch's log says why)"
            else:  # each family starts from torch._dynamo.reset(): every decode here compiles, or did not at all
                t["mode"] = "StaticCache, not compiled by generate()"
            return t
        except Exception as e:  # noqa: BLE001 - the family or implementation cannot: say so, run eager
            graphs_error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            print(f"  graphs decode failed, eager instead: {graphs_error[:300]}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    t = _decode_once(model, prompt, args, device, static=False)
    t["mode"] = "eager (DynamicCache)"
    t["graphs_error"] = graphs_error
    return t


def run_impl(model, args, device, prompts, decode_prompts):
    res = {}
    with torch.no_grad():
        if "prefill" in args.modes:
            res["prefill"] = {str(T): _guarded(lambda: prefill(model, p, args, device), device)
                              for T, p in prompts.items()}
        if "decode" in args.modes:
            res["decode"] = {str(B): _guarded(lambda: decode(model, p, args, device), device)
                             for B, p in decode_prompts.items()}
        if not args.no_profile:
            def profile():
                names = {}
                if prompts:
                    p = prompts[min(prompts)]
                    names["prefill"] = profiled_names(lambda: model(p, use_cache=True, logits_to_keep=1), device)
                if decode_prompts:
                    gen = _generator(model, decode_prompts[min(decode_prompts)], False, 3)
                    names["decode"] = profiled_names(lambda: gen(3), device)
                return names
            res["profiled"] = _guarded(profile, device)
    return res


# ---------------------------------------------------------------------------------------------------------
# one family
# ---------------------------------------------------------------------------------------------------------

def run_family(name, args, device, dtype):
    import m2ops.integrations.transformers as m2tf

    spec = families.FAMILIES[name]
    longest = max(args.seqlens + [args.decode_prompt + args.new_tokens])
    model, config = families.build(spec, args.n_layers, args.smoke, args.vocab, longest, device, dtype, args.seed)
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = {T: torch.randint(3, vocab, (1, T), generator=gen).to(device)
               for T in (args.seqlens if "prefill" in args.modes else [])}
    decode_prompts = {B: torch.randint(3, vocab, (B, args.decode_prompt), generator=gen).to(device)
                      for B in (args.batches if "decode" in args.modes else [])}
    m2tf.unpatch()
    module = next(f for f in m2tf.families() if f.name == name).module_name
    out = {"model": {**families.describe(spec, config, args.n_layers), "class": type(model).__name__,
                     "params": sum(p.numel() for p in model.parameters())},
           "transformers_path": transformers_path(module), "results": {}}
    torch._dynamo.reset()  # each family compiles afresh: no recompile limit reached through shared code
    try:
        for impl in args.impls:
            if impl == "m2ops":
                m2tf.patch(families=[name])
            else:
                m2tf.unpatch()
            print(f"{name}: {impl} ...", file=sys.stderr, flush=True)
            out["results"][impl] = run_impl(model, args, device, prompts, decode_prompts)
    finally:
        m2tf.unpatch()
        del model
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["checks"] = _compare(out["results"])
    return out


def _compare(results):
    """Per prompt length, last-token logits of m2ops against transformers: max abs difference over max abs value
    (the max relative error the docs quote) and the normwise relative difference; the logits leave the JSON."""
    checks = {}
    pre = {impl: r.get("prefill", {}) for impl, r in results.items()}
    for T in pre.get("transformers", {}):
        a, b = pre.get("m2ops", {}).get(T, {}), pre["transformers"][T]
        if "last_logits" in a and "last_logits" in b:
            x, y = a["last_logits"].double(), b["last_logits"].double()
            checks[T] = {"max_rel_err": float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)),
                         "norm_rel_err": rel_err(x, y)}
    for r in pre.values():
        for t in r.values():
            t.pop("last_logits", None)
    return {"last_logits": checks} if checks else {}


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def _cell(t, key, digits):
    if t is None:
        return "-"
    if "error" in t:
        return "error" if t["error"] != "out of memory" else "OOM"
    v = t.get(key)
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(name, fam, env, args):
    res, impls = fam["results"], [i for i in IMPLS if i in fam["results"]]
    m = fam["model"]
    title = (f"### {name}: {m['class']}, sizes of {m['checkpoint']}, layers {m['layers']} of "
             f"{m['checkpoint_layers']} ({', '.join(m['layer_kinds'])}), vocab {m['sizes'].get('vocab_size')}, "
             f"{args.dtype} on {env['device_name']}; median of {args.runs} runs after {args.warmup} warm-up")
    both = len(impls) == 2
    lines = ["| | " + " | ".join(impls) + (" | speedup |" if both else " |"),
             "|---" * (len(impls) + 1 + both) + "|"]

    def row(label, mode, key, sub, digits):
        cells = [res[i].get(mode, {}).get(sub) for i in impls]
        line = f"| {label} | " + " | ".join(_cell(c, key, digits) for c in cells)
        if both:
            v = [None if c is None or "error" in c else c.get(key) for c in cells]
            line += " | " + (f"{v[0] / v[1]:.2f}x" if None not in v and v[1] > 0 else "-")
        lines.append(line + " |")

    for T in args.seqlens if "prefill" in args.modes else []:
        row(f"prefill 1 x {T} tokens (ms)", "prefill", "median_ms", str(T), 2)
    for B in args.batches if "decode" in args.modes else []:
        row(f"decode batch {B} (ms/token)", "decode", "ms_per_token", str(B), 3)
    notes = [f"transformers: {fam['transformers_path']['summary']}",
             f"m2ops: {env['m2ops_backend']} (after patch(families=[{name!r}]))"]
    for impl in impls:
        modes = {d.get("mode") for d in res[impl].get("decode", {}).values() if "mode" in d}
        errors = {d["graphs_error"] for d in res[impl].get("decode", {}).values() if d.get("graphs_error")}
        if modes:
            notes.append(f"{impl} decode: {', '.join(sorted(modes))}"
                         + (f" (CUDA graphs failed: {sorted(errors)[0][:200]})" if errors else ""))
    for T, c in fam.get("checks", {}).get("last_logits", {}).items():
        notes.append(f"last-token logits after {T} tokens, m2ops vs transformers: max relative error "
                     f"{c['max_rel_err']:.2e} (normwise {c['norm_rel_err']:.2e})")
    for impl in impls:
        for mode in ("prefill", "decode"):
            for sub, t in res[impl].get(mode, {}).items():
                if "error" in t:
                    notes.append(f"{impl} {mode} {sub}: {t['error'][:200]}")
    notes.append(f"{fam.get('seconds', 0):.0f} s for this family, model building and compilations included")
    return "\n".join([title, "", *lines, "", *(f"- {n}" for n in notes)]) + "\n"


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    result = {"env": environment(device),
              "settings": {k: getattr(args, k) for k in ("families", "n_layers", "seqlens", "batches",
                                                         "decode_prompt", "new_tokens", "decode", "modes", "impls",
                                                         "vocab", "runs", "warmup", "dtype", "seed", "smoke")},
              "families": {}}
    result["settings"]["device"] = str(device)
    tables = []
    for name in args.families:
        t0 = time.perf_counter()
        try:
            fam = run_family(name, args, device, dtype)
        except Exception as e:  # noqa: BLE001 - a family that cannot be built here; the others go on
            fam = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
            print(f"{name}: {fam['error']}", file=sys.stderr, flush=True)
        fam["seconds"] = time.perf_counter() - t0
        result["families"][name] = fam
        tables.append(markdown(name, fam, result["env"], args) if "results" in fam
                      else f"### {name}: not run: {fam['error']}\n")
        print(tables[-1], flush=True)
        if args.out:
            result["markdown"] = "\n".join(tables)
            save_json(result, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return result
