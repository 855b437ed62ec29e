"""What the measurement scripts of measure/ share: command-line parsing, timing, JSON output and tables.

Importing it puts the repository root (m2ops without an install) and tests/gpu (gpu_cases: the scripts' cases,
the reference, rel_err) on sys.path, after the script's own folder, so `python measure/<script>.py` works from
any directory.

- Arguments: parser(__doc__) (the docstring as --help's text), shape ("16K:128" -> Shape(16384, 128)), shapes
  ("16K:128,64K:256"), sizes ("1K,4,0" -> [1024, 4, 0]), names ("a,b c" -> ["a", "b c"]), and add_shapes /
  add_chunk / add_json for the options most scripts take.
- Timing: median_ms (CUDA events, L2 flushed before each call, median; sleep=True queues a GPU sleep ahead of
  each call for host-free device times), host_us (the host's issue time per call, while the GPU sleeps),
  wall_us (host time of calls that need no GPU), kernel_times (each kernel's device time per call, torch
  profiler), cprofile (cProfile's table by own time), graphed (a call's CUDA-graph replay).
- The launchers' choices, overridden for a block: hints({kernel: {"occupancy": k}}) (ct.kernel hints in place of the
  package's tables), constants(NAME=value) (a module constant of m2ops, wherever it is read); the package's own
  knobs are config.override(field=value) (m2ops.kernels.config). Both clear the kept plans on entry and exit.
- Output: write_json (rows with the GPU's name, versions and git commit), Table / print_table (markdown).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_GPU = os.path.join(REPO, "tests", "gpu")
for _path in (TESTS_GPU, REPO):
    if _path not in sys.path:
        sys.path.insert(1, _path)

import torch  # noqa: E402

# ---- arguments ----


class Shape(NamedTuple):
    """A seqlen:dstate pair as given on the command line ("16K:128"); spec keeps the text for labels."""
    seqlen: int
    dstate: int
    spec: str

    def __str__(self):
        return self.spec


def sizes(text: str) -> list[int]:
    """"1K,4K,0,128" -> [1024, 4096, 0, 128]: comma-separated non-negative ints, a K (or k) suffix multiplying by
    1024; empty entries skipped ("" -> [])."""
    out = []
    for v in (v.strip() for v in text.split(",")):
        if not v:
            continue
        digits = v[:-1] if v[-1] in "Kk" else v
        if not (digits.isascii() and digits.isdigit()):
            raise argparse.ArgumentTypeError(f"expected comma-separated sizes such as 1K,4K,128 (K: times 1024); "
                                             f"got {text!r}")
        out.append(int(digits) * (1024 if digits != v else 1))
    return out


def shape(text: str) -> Shape:
    """"16K:128" -> Shape(16384, 128, "16K:128") (seqlen:dstate; also headdim:dstate and the like)."""
    parts = text.strip().split(":")
    try:
        got = [sizes(p) for p in parts] if len(parts) == 2 else []
    except argparse.ArgumentTypeError:
        got = []
    if len(got) != 2 or any(len(g) != 1 for g in got):
        raise argparse.ArgumentTypeError(f"expected a shape such as 16K:128 (seqlen:dstate); got {text!r}")
    return Shape(got[0][0], got[1][0], text.strip())


def shapes(text: str) -> list[Shape]:
    """"16K:128,64K:256" -> [Shape(16384, 128), Shape(65536, 256)]."""
    return [shape(s) for s in text.split(",") if s.strip()]


def names(text: str) -> list[str]:
    """Comma-separated names, empty entries skipped ("" -> [])."""
    return [s for s in text.split(",") if s]


def parser(doc: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help shows doc (pass the script's __doc__) as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_shapes(ap: argparse.ArgumentParser, default: str, one: bool = False, help: str | None = None):
    """--shapes (a list of seqlen:dstate; args.shapes: list[Shape]) or, with one, --shape (args.shape: Shape)."""
    if one:
        ap.add_argument("--shape", type=shape, default=default, help=help or "seqlen:dstate, e.g. 16K:128")
    else:
        ap.add_argument("--shapes", type=shapes, default=default,
                        help=help or "comma-separated seqlen:dstate, e.g. 16K:128,64K:256")


def add_chunk(ap: argparse.ArgumentParser, default: int = 256):
    ap.add_argument("--chunk", type=int, default=default, help=f"chunk size (default {default})")


def add_json(ap: argparse.ArgumentParser):
    ap.add_argument("--json", default=None, metavar="OUT",
                    help="also write the rows to OUT, with the GPU, versions and commit (write_json)")


def serve_prefill_args(argv: list[str]):
    """(bench.serve's parsed prefill options, --json's OUT or None) from a script's argv: the scripts that time
    bench.serve's chunked prefill take its options as they are, plus --json."""
    from m2ops.bench.serve import parse_args
    json_path = None
    if "--json" in argv:
        i = argv.index("--json")
        json_path = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    return parse_args(["--modes", "prefill", *argv]), json_path


# ---- timing ----

SLEEP_CLOCK_HZ = 2.0e9  # torch.cuda._sleep counts GPU cycles: about 2 GHz on the H100 and H200


def gpu_sleep(seconds: float):
    """Queue a kernel that keeps the GPU busy for about seconds; the host goes on at once."""
    torch.cuda._sleep(int(seconds * SLEEP_CLOCK_HZ))


_FLUSH = {}


def _flush_buffer(device) -> torch.Tensor:
    """A buffer twice the L2 cache (64 MiB at least) whose zeroing evicts everything else from L2."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FLUSH:
        l2 = torch.cuda.get_device_properties(index).L2_cache_size
        _FLUSH[index] = torch.empty(max(2 * l2, 1 << 26), dtype=torch.uint8, device=f"cuda:{index}")
    return _FLUSH[index]


def median_ms(fn, runs: int = 100, warmup: int = 10, *, flush_l2: bool = True, sleep: bool = False,
              device="cuda") -> float:
    """Median device time of one call of fn in ms, from CUDA events recorded around each call, after warmup calls.

    flush_l2: zero a buffer twice the L2's size before each call, so that every call reads its inputs from HBM.
    sleep: queue a GPU sleep ahead of each call that outlasts the host's issue of it, and wait for each call
      before the next: the events then time the kernels back to back whatever the host's speed (an eager call at
      short sequences is host-bound; a CUDA graph replays it without the host).
    Without sleep the calls are queued back to back and synchronised once at the end. The defaults are the
    benchmark's protocol (m2ops.bench.timing.median_ms); HOST_FREE is the autotuner's (m2ops.kernels.scan
    .median_ms: a sleep, no flush, 20 runs).
    """
    flush = _flush_buffer(device) if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    sleep_s = 0.0
    if sleep:
        t0 = time.perf_counter()
        if flush is not None:
            flush.zero_()
        fn()
        sleep_s = 2 * (time.perf_counter() - t0) + 50e-6
        torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        if sleep:
            gpu_sleep(sleep_s)
        if flush is not None:
            flush.zero_()
        s.record()
        fn()
        e.record()
        if sleep:
            e.synchronize()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


# The kernels' own time, the host kept out: how the autotuner times its candidates.
HOST_FREE = dict(runs=20, warmup=1, flush_l2=False, sleep=True)


def host_us(fn, n: int, per_call_s: float | None = 200e-6, rounds: int = 5, device_time: bool = False):
    """The host's wall time per call of fn in microseconds, over n calls issued while the GPU sleeps (so that the
    host never waits on the device); the median of rounds rounds, after one warm-up call.

    The sleep lasts n * per_call_s + 2 ms, which must exceed the host's time for the n calls; per_call_s=None
    takes twice one call's wall time (host and device, measured after the warm-up). device_time: also the
    device's time per call of the same n calls (CUDA events around them; they run back to back once the sleep
    ends), returned as (host us, device us).
    """
    fn()
    torch.cuda.synchronize()
    if per_call_s is None:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        per_call_s = 2 * (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, dev = [], []
    for _ in range(rounds):
        gpu_sleep(n * per_call_s + 0.002)
        if device_time:
            start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) / n * 1e6)
        if device_time:
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / n * 1e3)
        else:
            torch.cuda.synchronize()
    mid = rounds // 2
    return (sorted(host)[mid], sorted(dev)[mid]) if device_time else sorted(host)[mid]


def wall_us(fn, n: int, warmup: int = 20) -> float:
    """The host's wall time per call of fn in microseconds, the mean over n calls after warmup calls: for calls
    that never touch a GPU (no synchronisation)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def cprofile(fn, calls: int, rows: int = 25) -> str:
    """cProfile's table of `calls` calls of fn, the `rows` functions with the most own time first (a GPU, where
    there is one, is synchronised before the table is made)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


# Forward kernel names as they appear in the profiler (each a substring of its cuTile symbols, with "_kernel").
KERNEL_NAMES = ("chunk_cumsum", "chunk_state", "state_passing", "varlen_states", "chunk_cb", "compute_out",
                "compute_out_carry")


def kernel_bucket(names=KERNEL_NAMES):
    """symbol -> the first of names whose "<name>_kernel" the symbol contains, else "other"."""
    def bucket(symbol: str) -> str:
        return next((k for k in names if k + "_kernel" in symbol), "other")
    return bucket


def kernel_times(fn, reps: int = 10, bucket=None) -> dict:
    """Device ms per call of the kernels fn launches over reps calls (torch profiler, after one call outside it),
    summed by bucket(symbol) (default kernel_bucket(): the forward kernels by name and "other"; e.g.
    m2ops.bench.kernels.short_name for every kernel by name). {} when the profiler cannot record CUDA kernels."""
    bucket = bucket or kernel_bucket()
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = getattr(ev, "self_cuda_time_total", 0.0)
            if not us:
                continue
            name = bucket(ev.key)
            out[name] = out.get(name, 0.0) + us / 1000.0 / reps
        return out
    except Exception as e:  # noqa: BLE001 - per-kernel times are a bonus; the calls are timed anyway
        print(f"     (no per-kernel times: {type(e).__name__}: {e})", flush=True)
        return {}


def op_sources(fn, reps: int = 5, top: int = 15, frames: int = 3) -> list:
    """Where the device time outside m2ops's own kernels comes from: the PyTorch ops fn runs, grouped by the Python
    lines that called them, the top ones by device time per call (CPU time without CUDA), as
    [{"op", "ms", "count", "stack": [m2ops frames, innermost first]}] (torch profiler with stacks, after one call
    outside it). For copies and casts whose kernels the kernel table shows only by their ATen names."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # (verbose: without it the events carry no Python frames in torch 2.11)
    with profile(activities=acts, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages(group_by_stack_n=12):
        if not ev.key.startswith("aten::"):
            continue
        us = (getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)) if cuda \
            else ev.self_cpu_time_total
        stack = [f for f in (ev.stack or []) if "m2ops" in f and "measure/" not in f][:frames]
        if us and stack:
            rows.append({"op": ev.key, "ms": us / 1000.0 / reps, "count": ev.count // reps, "stack": stack})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def graphed(fn):
    """fn captured in a CUDA graph after warm-up calls on a side stream; returns the graph's replay (the
    benchmark's own capture, m2ops.bench.timing.graphed)."""
    from m2ops.bench.timing import graphed as capture
    return capture(fn)


# ---- the launchers' choices, overridden ----
# The package has no profiling hooks of its own: its knobs are the fields of m2ops.kernels.config.current(), set
# with `with config.override(field=value):` (part of every kept plan's key). What a measurement varies beyond them
# (occupancy hints, module constants) it patches from here, for the duration of a block, and the kept plans (which
# hold kernel objects, hints and grids) are forgotten on entry and exit.


def _m2ops_modules():
    """The modules of the m2ops package, every launcher module among them (imported here, so that none imported
    later, inside a block, takes a patched value by name and keeps it after the block)."""
    import importlib
    import pkgutil

    import m2ops.kernels
    for info in pkgutil.iter_modules(m2ops.kernels.__path__, "m2ops.kernels."):
        importlib.import_module(info.name)
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "m2ops" or
                                                                              name.startswith("m2ops."))]


def _forget_plans():
    """Forget what the launchers keep: the table-hinted kernel objects and every kept plan."""
    from m2ops.kernels import runtime, specialise
    clear = getattr(specialise.hinted_kernel, "cache_clear", None)
    if clear is not None:
        clear()
    runtime.clear_plans()


@contextlib.contextmanager
def _rebound(replacements: dict):
    """name -> (old, new): new bound to name, for the duration, in every m2ops module where name is bound to old
    (its defining module and each that imported it by name); plans forgotten on entry and exit."""
    changed = []
    try:
        for name, (old, new) in replacements.items():
            for module in _m2ops_modules():
                if getattr(module, name, None) is old:
                    setattr(module, name, new)
                    changed.append((module, name, old))
        _forget_plans()
        yield
    finally:
        for module, name, old in reversed(changed):
            setattr(module, name, old)
        _forget_plans()


@contextlib.contextmanager
def hints(overrides: dict):
    """The launchers' ct.kernel hints with overrides for the duration of the block: kernel name (a key of
    m2ops.kernels.registry.KERNELS) -> hints dict ({"occupancy": k}; {} builds that kernel without hints), in
    place of the package's choice for that kernel wherever it makes one: specialise.kernel_hints (the occupancy
    tables, through hinted_kernel), specialise.chunk_state_hints ("chunk_state": also its builds of several heads
    per program and the fused chunk_state_cumsum_cb, which take chunk_state's hints), specialise.out_carry_hints
    ("compute_out_carry") and decode.state_update_hints / state_update_kernel_for ("state_update": also its
    16-byte-aligned build). Each function is replaced in every module that imported it by name. hints({}) changes
    nothing but forgets the kept plans. Nests (an inner block's entries win)."""
    from m2ops.kernels import decode, registry, specialise
    unknown = sorted(set(overrides) - set(registry.KERNELS))
    if unknown:
        raise ValueError(f"hints: unknown kernels {unknown}; known: {', '.join(registry.KERNELS)}")
    got = {name: dict(h) for name, h in overrides.items()}

    def given(name):
        return dict(got[name]) if name in got else None

    kernel_hints = specialise.kernel_hints
    chunk_state_hints = specialise.chunk_state_hints
    out_carry_hints = specialise.out_carry_hints
    state_update_hints = decode.state_update_hints
    state_update_kernel_for = decode.state_update_kernel_for

    def new_kernel_hints(kernel_name, dtype, chunk_size):
        h = given(kernel_name)
        return kernel_hints(kernel_name, dtype, chunk_size) if h is None else h

    def new_chunk_state_hints(dtype, chunk_size, heads):
        h = given("chunk_state")
        return chunk_state_hints(dtype, chunk_size, heads) if h is None else h

    def new_out_carry_hints(dtype, tn):
        h = given("compute_out_carry")
        return out_carry_hints(dtype, tn) if h is None else h

    def new_state_update_hints(dtype, aligned):
        h = given("state_update")
        return state_update_hints(dtype, aligned) if h is None else h

    def new_state_update_kernel_for(dtype, aligned):
        h = given("state_update")
        if h is None:
            return state_update_kernel_for(dtype, aligned)
        return specialise.hinted("state_update", tuple(sorted(h.items())))

    with _rebound({"kernel_hints": (kernel_hints, new_kernel_hints),
                   "chunk_state_hints": (chunk_state_hints, new_chunk_state_hints),
                   "out_carry_hints": (out_carry_hints, new_out_carry_hints),
                   "state_update_hints": (state_update_hints, new_state_update_hints),
                   "state_update_kernel_for": (state_update_kernel_for, new_state_update_kernel_for)}):
        yield


@contextlib.contextmanager
def constants(**values):
    """Module constants of m2ops set for the duration of the block: NAME=value rebinds NAME in every m2ops module
    that binds it to the same object as the first module found with it (the defining module and each that
    imported it by name, e.g. common.SEGMENT_PROGRAMS_PER_SM and scan's copy). The launchers read such constants
    when they work out a plan, so the kept plans are forgotten on entry and exit. A name no m2ops module binds
    is an error (a renamed constant must not pass unnoticed)."""
    replacements = {}
    for name, value in values.items():
        holder = next((m for m in _m2ops_modules() if hasattr(m, name)), None)
        if holder is None:
            raise AttributeError(f"constants: no m2ops module binds {name}")
        replacements[name] = (getattr(holder, name), value)
    with _rebound(replacements):
        yield


# ---- output ----


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it) of the repository, (None, None) outside a git tree."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=10, check=True).stdout.strip()
        return run("rev-parse", "HEAD"), bool(run("status", "--porcelain", "--untracked-files=no"))
    except Exception:  # noqa: BLE001 - no git, or not a checkout (a copied tree)
        return None, None


def environment() -> dict:
    """The GPU, the versions that decide a measurement, the commit and the command line."""
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    commit, dirty = git_commit()
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_tile": version("cuda-tile"),
            "m2ops": version("m2ops"), "python": platform.python_version(), "commit": commit, "dirty": dirty,
            "argv": [os.path.relpath(sys.argv[0], REPO) if sys.argv and sys.argv[0] else ""] + sys.argv[1:],
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(path: str | None, rows, **extra):
    """{"env": environment(), **extra, "rows": rows} to path as indented JSON (nothing where path is None);
    values JSON cannot hold (dtypes, devices) are written as their str()."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"env": environment(), **extra, "rows": rows}, f, indent=1, default=str)


class Table:
    """A markdown table printed row by row, each line flushed (a slow run shows each row as it comes).

    columns: keys of the row dicts, or (key, title) pairs. Floats are written with floatfmt, None as "-"."""

    def __init__(self, columns, floatfmt: str = ".3f"):
        self.columns = [c if isinstance(c, tuple) else (c, str(c)) for c in columns]
        self.floatfmt = floatfmt

    def cell(self, v) -> str:
        if v is None:
            return "-"
        return format(v, self.floatfmt) if isinstance(v, float) else str(v)

    def header(self):
        print("| " + " | ".join(title for _, title in self.columns) + " |")
        print("|" + "---|" * len(self.columns), flush=True)

    def row(self, r: dict):
        print("| " + " | ".join(self.cell(r.get(key)) for key, _ in self.columns) + " |", flush=True)


def print_table(rows, columns=None, floatfmt: str = ".3f"):
    """rows (dicts) as one markdown table; columns default to the first row's keys."""
    rows = list(rows)
    table = Table(columns or (list(rows[0]) if rows else []), floatfmt)
    table.header()
    for r in rows:
        table.row(r)
