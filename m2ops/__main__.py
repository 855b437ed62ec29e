"""python -m m2ops: the main job. A Mamba-2 SSD workload through torch.compile on the best device present,
timed, and checked against the token-by-token float64 recurrence."""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import time

import torch

from . import mamba_chunk_scan_combined
from .ops import dispatch
from .reference.naive import naive_scan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative error (max |y - y_naive| / max |y_naive|) allowed per input dtype: inputs are rounded to the
# dtype before both runs, so what remains is accumulation order and the output's rounding.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help (flags and unset options have none
    worth showing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (action.option_strings and "%(default)" not in text and "(default" not in text
                and d is not None and d is not False and d != [] and d is not argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text

    def _split_lines(self, text, width):  # no breaks inside peer names such as mamba_ssm-c128-graph
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, prog and message, with exit code 2: the usage block that
    argparse prints first hides the message on a narrow terminal."""

    def __init__(self, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(least: int):
    """An argparse type: an int of at least `least` (1: positive, 0: non-negative)."""
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer >= {least}")

    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < least:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
        return v

    parse.__name__ = what  # argparse names the type in some of its own messages
    return parse


def device(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N, checked against what this machine has."""
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N; got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"got {text!r}, but torch {torch.__version__} sees no CUDA device "
                                             "here; use cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"got {text!r}, but there are {torch.cuda.device_count()} CUDA "
                                             f"devices (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return text


def parse_args(argv=None):
    """The options, each checked here (a bad one exits with one line and code 2) so that no error surfaces
    later from inside torch.compile's trace."""
    p = Parser(prog="python -m m2ops", description=__doc__)
    pos, nonneg = integer(1), integer(0)
    p.add_argument("--batch", type=pos, default=2, help="rows")
    p.add_argument("--seqlen", type=pos, default=1000, help="tokens per row (need not divide by chunk size)")
    p.add_argument("--nheads", type=pos, default=8, help="heads")
    p.add_argument("--headdim", type=pos, default=64, help="channels per head")
    p.add_argument("--dstate", type=pos, default=64, help="state size per channel")
    p.add_argument("--ngroups", type=pos, default=1, help="groups of heads sharing B and C; must divide --nheads")
    p.add_argument("--chunk-size", type=pos, default=128, help="tokens per chunk of the chunked scan")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--sequences", type=pos, default=1,
                   help="pack this many sequences per row (seq_idx), at most --seqlen; 1 for plain rows")
    p.add_argument("--repeats", type=nonneg, default=5, help="timed calls after the first (compiling) one")
    p.add_argument("--no-compile", action="store_true", help="run eagerly instead of torch.compile")
    p.add_argument("--seed", type=nonneg, default=0, help="seed of the random inputs")
    a = p.parse_args(argv)
    if a.nheads % a.ngroups:
        p.error(f"argument --ngroups: expected a divisor of --nheads ({a.nheads}); got {a.ngroups}")
    if a.sequences > a.seqlen:
        p.error(f"argument --sequences: expected at most --seqlen ({a.seqlen}), every sequence holding a token; "
                f"got {a.sequences}")
    if a.seed >= 2 ** 64:
        p.error(f"argument --seed: expected less than 2**64 (a torch generator seed); got {a.seed}")
    return a


def make_inputs(a, device, dtype):
    """A Mamba-2 layer's scan inputs: softplus(dt + dt_bias), A < 0, D per head, z gate, initial state."""
    g = torch.Generator().manual_seed(a.seed)
    b, T, h, p, G, n = a.batch, a.seqlen, a.nheads, a.headdim, a.ngroups, a.dstate

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    inputs = dict(
        x=randn(b, T, h, p).to(dtype), dt=randn(b, T, h, scale=0.5), A=-torch.rand(h, generator=g).add(0.5).to(device),
        B=randn(b, T, G, n, scale=n ** -0.5).to(dtype), C=randn(b, T, G, n, scale=n ** -0.5).to(dtype),
        D=randn(h), z=randn(b, T, h, p).to(dtype), dt_bias=randn(h, scale=0.5) - 2.0,
        initial_states=randn(b, h, p, n, scale=0.1), dt_softplus=True)
    if a.sequences > 1:
        cuts = torch.randperm(T - 1, generator=g)[: a.sequences - 1].add(1).sort().values
        seq = torch.zeros(T, dtype=torch.int32)
        seq[cuts] = 1
        inputs["seq_idx"] = seq.cumsum(0, dtype=torch.int32).expand(b, T).contiguous().to(device)
    return inputs


def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv=None):
    a = parse_args(argv)
    device = pick_device(a.device)
    dtype = DTYPES[a.dtype] if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = "cuTile kernels" if device.type == "cuda" and dispatch.use_kernels(device) else "PyTorch reference"
    inputs = make_inputs(a, device, dtype)

    def scan(inputs):
        return mamba_chunk_scan_combined(chunk_size=a.chunk_size, return_final_states=True, **inputs)

    fn = scan if a.no_compile else torch.compile(scan, fullgraph=True)
    print(f"m2ops {device} ({backend}), {'eager' if a.no_compile else 'torch.compile(fullgraph=True)'}: "
          f"batch={a.batch} seqlen={a.seqlen} nheads={a.nheads} headdim={a.headdim} dstate={a.dstate} "
          f"ngroups={a.ngroups} chunk={a.chunk_size} {str(dtype).replace('torch.', '')} sequences={a.sequences}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    y, final = fn(inputs)
    sync()
    print(f"first call (compile + run): {time.perf_counter() - t0:.2f} s")
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        fn(inputs)
        sync()
        times.append(time.perf_counter() - t0)
    if times:
        times.sort()
        ms = 1e3 * times[len(times) // 2]
        tokens = a.batch * a.seqlen / (ms / 1e3)
        rate = f"{tokens / 1e6:.2f} M" if tokens >= 1e6 else f"{tokens / 1e3:.1f} K"
        print(f"median of {a.repeats} calls: {ms:.3f} ms ({rate} tokens/s)")

    y_ref, final_ref, _ = naive_scan(**{k: v for k, v in inputs.items()})
    err = ((y.double().cpu() - y_ref).abs().max() / y_ref.abs().max()).item()
    err_state = ((final.double().cpu() - final_ref).abs().max() / final_ref.abs().max()).item()
    tol = TOLERANCE[dtype]
    ok = err <= tol and err_state <= tol and math.isfinite(err) and math.isfinite(err_state)
    print(f"vs token-by-token float64 recurrence: output rel. error {err:.2e}, final state {err_state:.2e} "
          f"(tolerance {tol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
