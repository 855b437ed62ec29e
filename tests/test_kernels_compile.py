"""The kernel specialisations the launchers can launch compile ahead of time, without a GPU.

cuda.tile.compilation runs the cuTile front end (Python to Tile IR bytecode, the same bytecode for every
architecture, about 0.12 s of CPU a specialisation) and tileiras (bytecode to a cubin for one architecture, 0.3 to
11 s a specialisation). m2ops.kernels.specs.all_specs() lists each specialisation with 64-bit indexing and its
32-bit-indexed twin (Spec.narrow), about 1,700 in all: too many to build for three architectures on every CI run.
Two sets per kernel:

The quick set (while a kernel is as its last full run built it, see below; it guards against a changed toolchain
or environment, the full run having built every specialisation of these very sources):
- sm_80, sm_90 and sm_100: the kernel's largest and smallest specialisation (tiles, dtypes), to a cubin;
- sm_90: the same two of its 32-bit-indexed twins, to a cubin;
- through the front end, to bytecode: other specialisations covering every pair of values of its features, its
  64-bit and 32-bit-indexed ones apart (about 700 of the 2,100 left; lowering all of them took over 3 minutes of
  a 2-core CI run).

The full set (a kernel whose sources or specialisations changed):
- sm_90, the GPU the kernels are tuned and measured on: every specialisation with 64-bit indexing, to a cubin;
- sm_80 and sm_100: specialisations that cover every pair of values of its features (dtype, each constant, each
  hint, each extra dtype), largest tiles and widest dtypes first, to a cubin;
- sm_90: 32-bit-indexed twins that cover every value of its features, to a cubin; every other specialisation
  to bytecode.
(Every kernel's full set: about 1,400 cubins, over half an hour on 2 cores.)

Which set runs, kernel by kernel: tests/compiled_kernels.sha256 holds one digest per kernel (_digests: its module,
the kernel modules that module imports, common.py and index_width.py, the signature builder, and the name and
run-time parameters of each of its specialisations). A kernel whose digest is recorded gets the quick set; one
whose digest differs or is missing gets the full set (for sm_90 every specialisation, for sm_80 and sm_100 every
pair of values). M2OPS_COMPILE_ALL=1 builds every kernel's full set, M2OPS_COMPILE_ALL=0 only quick sets. A run
in which every part passes records the digests of the kernels it built in full: after changing a kernel (or its
specialisations), run

    M2OPS_COMPILE_ALL=1 M2OPS_COMPILE_KERNELS=name,... .venv/bin/python -m pytest -q tests/test_kernels_compile.py

(M2OPS_COMPILE_KERNELS=name,... limits every part to those kernels; without it, every kernel: over half an hour on
2 cores) and commit tests/compiled_kernels.sha256 with the change. Until then CI builds that kernel's full set
(slower, but no kernel source lands without every specialisation built for sm_90), and says so: the run names the
sets it builds and why, on the terminal and in the warnings summary.

Skipped when cuda.tile (or tileiras) is not installed. A failing test names every specialisation that did not
build. Builds run in one pool of processes over all cores (tileiras is single-threaded and cuTile serialises
compiles within a process), longest first; cuTile's disk cache makes repeated runs fast. cuTile reads a kernel's
source file when it compiles it: editing the kernels during a run gives spurious failures.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import inspect
import io
import itertools
import math
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

ARCHS = ("sm_80", "sm_90", "sm_100")
# Every specialisation is built for this one in a full run; the others get pairwise covers.
FULL_ARCH = "sm_90"
RECORD = Path(__file__).with_name("compiled_kernels.sha256")
RECORD_COMMAND = "M2OPS_COMPILE_ALL=1 .venv/bin/python -m pytest -q tests/test_kernels_compile.py"
NARROW = f"{FULL_ARCH}-index32"   # the part that builds 32-bit twins
FRONT_END = "front-end"           # the part that lowers every specialisation no other part builds


def _tileiras_missing():
    try:
        from cuda.tile._compile import _find_compiler_bin
        _find_compiler_bin()
    except Exception as e:  # noqa: BLE001 - private helper; any failure means we cannot compile here
        return str(e)
    return None


_missing = _tileiras_missing()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_missing is not None, reason=f"tileiras not available: {_missing}")]


# ---------------------------------------------------------------------------------------------------------
# building, in worker processes
# ---------------------------------------------------------------------------------------------------------

_WORKER_SPECS = {}


def _worker_init():
    from m2ops.kernels.specs import all_specs
    _WORKER_SPECS.update((s.name, s) for s in all_specs())


def _build(name: str, arch: str | None):
    """Build the specialisation called name in this (worker) process, to an arch cubin, or to bytecode when arch
    is None: None, or the error text."""
    from cuda.tile.compilation import export_kernel

    fmt = "tileir_bytecode" if arch is None else "cubin"
    try:
        spec = _WORKER_SPECS[name]
        export_kernel(spec.kernel, [spec.signature()], io.BytesIO(), gpu_code=arch, output_format=fmt)
    except Exception:  # noqa: BLE001 - reported by the test with the specialisation's name
        return f"{name} on {arch or 'the front end'}:\n{traceback.format_exc(limit=3)}"
    return None


def _workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


# ---------------------------------------------------------------------------------------------------------
# choosing specialisations
# ---------------------------------------------------------------------------------------------------------

def _features(spec) -> frozenset:
    """What tells spec apart from the other specialisations of its kernel, as (name, value) items."""
    items = [("dtype", spec.dtype), *spec.dtypes, *spec.constants.items(), *spec.hints]
    return frozenset((k, str(v)) for k, v in items)


def _size(spec) -> float:
    """Larger for larger tiles and wider dtypes: builds that need more registers and shared memory come first."""
    ints = [v for v in spec.constants.values() if isinstance(v, int) and not isinstance(v, bool)]
    wide = sum(d == "float32" for d in (spec.dtype, *(d for _, d in spec.dtypes)))
    return math.prod(ints) * 4 ** wide


def covering(indices, order: int, specs=None) -> list[int]:
    """Greedily chosen indices of specs (default all_specs()) among indices such that, for each kernel, every
    combination of `order` feature values that some specialisation has is had by a chosen one."""
    if specs is None:
        from m2ops.kernels.specs import all_specs
        specs = all_specs()
    chosen = []
    by_kernel = {}
    for i in indices:
        by_kernel.setdefault(specs[i].kernel_name, []).append(i)
    for members in by_kernel.values():
        members = sorted(members, key=lambda i: -_size(specs[i]))  # ties go to the larger build
        combos = {i: {frozenset(c) for r in range(1, order + 1)
                      for c in itertools.combinations(sorted(_features(specs[i])), r)} for i in members}
        need = set().union(*combos.values())
        while need:
            best = max(members, key=lambda i: len(combos[i] & need))
            chosen.append(best)
            need -= combos[best]
    return sorted(chosen)


def _wide(specs=None):
    if specs is None:
        from m2ops.kernels.specs import all_specs
        specs = all_specs()
    return [i for i, s in enumerate(specs) if not s.narrow]


def _narrow(specs=None):
    if specs is None:
        from m2ops.kernels.specs import all_specs
        specs = all_specs()
    return [i for i, s in enumerate(specs) if s.narrow]


# ---------------------------------------------------------------------------------------------------------
# what the last full runs built: tests/compiled_kernels.sha256, one digest per kernel
# ---------------------------------------------------------------------------------------------------------

_IMPORT = re.compile(r"^from \.(\w+) import|^from \. import ([\w, ]+)", re.M)


def _kernel_files(kernel_name: str, kdir: Path) -> list[Path]:
    """The source files whose text decides what kernel_name's specialisations compile to: its module, the modules of
    m2ops/kernels that module imports (transitively: the device helpers it calls), common.py and index_width.py (the
    32-bit twins)."""
    from m2ops.kernels.registry import KERNELS
    files = {kdir / "common.py", kdir / "index_width.py"}
    todo = [Path(inspect.getsourcefile(KERNELS[kernel_name]._pyfunc)).resolve()]
    while todo:
        path = todo.pop()
        if path in files and path.name not in ("common.py", "index_width.py"):
            continue
        files.add(path)
        for one, many in _IMPORT.findall(path.read_text(encoding="utf-8")):
            for name in ([one] if one else [n.strip() for n in many.split(",")]):
                dep = kdir / f"{name}.py"
                if dep.exists() and dep not in files:
                    todo.append(dep)
    return sorted(files)


def _digests(specs, root=None) -> dict:
    """kernel name -> sha256 over the text of its _kernel_files (as paths relative to root, default the directory
    above m2ops, line endings normalised), the signature builder (specs._signature) and each of its
    specialisations' name and run-time parameters, sorted."""
    import m2ops
    import m2ops.kernels
    from m2ops.kernels import specs as specs_module
    root = root or Path(m2ops.__file__).resolve().parent.parent
    kdir = Path(m2ops.kernels.__file__).resolve().parent
    signature = inspect.getsource(specs_module._signature).encode()
    out = {}
    for name in sorted({s.kernel_name for s in specs}):
        h = hashlib.sha256(b"m2ops compiled kernel 2\n")
        h.update(signature)
        for path in _kernel_files(name, kdir):
            rel = path.relative_to(root).as_posix()
            text = path.read_bytes().replace(b"\r\n", b"\n")
            h.update(f"{rel}\0{len(text)}\0".encode())
            h.update(text)
        for line in sorted(f"{s.name}\0{s.params!r}\n" for s in specs if s.kernel_name == name):
            h.update(line.encode())
        out[name] = h.hexdigest()
    return out


def _recorded(path: Path | None = None) -> dict:
    """kernel name -> the digest path (default RECORD) holds for it (lines "digest name"; # comments), empty when
    there is no such file."""
    path = path or RECORD
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.lstrip().startswith("#"):
            out[parts[1]] = parts[0]
    return out


def _record(digests: dict, path: Path) -> None:
    try:
        from importlib.metadata import version
        built_with = f"cuda-tile {version('cuda-tile')}"
    except Exception:  # noqa: BLE001 - only informative
        built_with = "cuda-tile (version unknown)"
    text = (f"# sha256 of each kernel's sources and specialisations as the last full run of\n"
            f"# tests/test_kernels_compile.py built them ({built_with}); written by that run. CI builds the full\n"
            f"# set of a kernel whose digest differs, the quick set of the others. After a kernel change:\n"
            f"# {RECORD_COMMAND}   (M2OPS_COMPILE_KERNELS=name,... limits it to those kernels)\n"
            + "".join(f"{d} {name}\n" for name, d in sorted(digests.items())))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# the plan of a run
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    specs: list
    changed: frozenset         # kernels whose full set this run builds
    why: str                   # why this set
    digests: dict
    subset: tuple = ()         # M2OPS_COMPILE_KERNELS, when set: only these kernels
    # part name -> (arch, or None for the front end, indices of specs, what they are)
    parts: dict = field(default_factory=dict)
    passed: set = field(default_factory=set)

    @property
    def full(self) -> bool:
        return bool(self.changed)

    def describe(self) -> str:
        cubins = sum(len(ix) for arch, ix, _ in self.parts.values() if arch is not None)
        kinds = "; ".join(f"{p}: {len(ix)} ({what})" for p, (_, ix, what) in self.parts.items())
        which = (f"the full set of {len(self.changed)} kernel(s), the quick set of the rest" if self.changed
                 else "the quick set")
        return f"{which}, {cubins} cubins ({self.why}). {kinds}"


def extremes(indices, specs) -> list[int]:
    """For each kernel among indices of specs, its largest and its smallest specialisation (_size)."""
    by_kernel = {}
    for i in indices:
        by_kernel.setdefault(specs[i].kernel_name, []).append(i)
    chosen = set()
    for members in by_kernel.values():
        ordered = sorted(members, key=lambda i: (-_size(specs[i]), i))
        chosen |= {ordered[0], ordered[-1]}
    return sorted(chosen)


def _choose(specs, changed) -> dict:
    wide, narrow = _wide(specs), _narrow(specs)
    full = [i for i in wide if specs[i].kernel_name in changed]
    rest = [i for i in wide if specs[i].kernel_name not in changed]
    parts = {}
    for arch in ARCHS:
        if arch == FULL_ARCH:
            cover, what = full, "every specialisation of a changed kernel"
        else:
            cover, what = covering(full, 2, specs), "each pair of values of a changed kernel's features"
        what = f"{what}; the others' largest and smallest" if changed else "each kernel's largest and smallest"
        parts[arch] = (arch, sorted(cover + extremes(rest, specs)), what)
    narrow_full = [i for i in narrow if specs[i].kernel_name in changed]
    narrow_rest = [i for i in narrow if specs[i].kernel_name not in changed]
    parts[NARROW] = (FULL_ARCH, sorted(covering(narrow_full, 1, specs) + extremes(narrow_rest, specs)),
                     "32-bit twins: each value of a changed kernel's features, the others' largest and smallest")
    built = set().union(*(ix for _, ix, _ in parts.values()))
    left = [i for i in range(len(specs)) if i not in built]
    # A kernel with a recorded digest had every specialisation built by the run that recorded it, with this
    # pinned toolchain: re-lowering all of them (about 2,100, over 3 minutes on 2 cores) adds little.
    kept = [i for i in left if specs[i].kernel_name not in changed]
    lowered = sorted([i for i in left if specs[i].kernel_name in changed]
                     + covering([i for i in kept if not specs[i].narrow], 2, specs)
                     + covering([i for i in kept if specs[i].narrow], 2, specs))
    what = "each pair of values of the other specialisations' features, to bytecode"
    parts[FRONT_END] = (None, lowered, ("a changed kernel's rest and " + what) if changed else what)
    return parts


def make_plan(specs, recorded: dict, forced: bool | None = None, subset: tuple = ()) -> Plan:
    """What to build: forced is M2OPS_COMPILE_ALL (None when unset), subset M2OPS_COMPILE_KERNELS's names."""
    digests = _digests(specs)
    names = set(digests)
    subset = tuple(subset)
    unknown = sorted(set(subset) - names)
    if unknown:
        raise ValueError(f"M2OPS_COMPILE_KERNELS names no kernel called {', '.join(unknown)}")
    stale = frozenset(n for n in names if recorded.get(n) != digests[n])
    file = f"tests/{RECORD.name}"
    state = (f"{file} matches every kernel's sources and specialisations" if not stale
             else f"{file} holds no digest or another one for {', '.join(sorted(stale))}")
    if forced is True:
        changed, why = frozenset(names), "M2OPS_COMPILE_ALL=1"
    elif forced is False:
        changed, why = frozenset(), f"M2OPS_COMPILE_ALL=0; {state}"
    else:
        changed, why = stale, state
    if subset:
        changed &= set(subset)
        why += f"; only {', '.join(subset)} (M2OPS_COMPILE_KERNELS)"
    parts = _choose(specs, changed)
    if subset:
        parts = {p: (arch, [i for i in ix if specs[i].kernel_name in subset], what)
                 for p, (arch, ix, what) in parts.items()}
    return Plan(specs, changed, why, digests, subset, parts)


def _announce(request, text: str):
    """text on the terminal now, past pytest's output capture (and -q)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is None:
        return
    if capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(text)
    else:
        reporter.write_line(text)


def finish(plan: Plan, path: Path | None = None) -> str | None:
    """After the module: where every part passed, records in path (default RECORD) the digests of the kernels whose
    full set this run built (the others keep theirs); what to tell, if anything."""
    path = path or RECORD
    if not plan.full:
        return None
    missing = [p for p in plan.parts if p not in plan.passed]
    if missing:
        return (f"test_kernels_compile: nothing recorded in tests/{path.name}: "
                f"{', '.join(missing)} did not run or did not pass")
    recorded = _recorded(path)
    now = {n: d for n, d in recorded.items() if n in plan.digests}  # (a removed kernel's line goes)
    now.update((n, plan.digests[n]) for n in plan.changed)
    if now == recorded:
        return None
    _record(now, path)
    return (f"test_kernels_compile: the full sets of {', '.join(sorted(plan.changed))} built; recorded their "
            f"digests in tests/{path.name}: commit it with the kernel change")


@pytest.fixture(scope="module")
def plan(request):
    from m2ops.kernels.specs import all_specs
    from m2ops import envvars
    subset = tuple(n.strip() for n in os.environ.get("M2OPS_COMPILE_KERNELS", "").split(",") if n.strip())
    p = make_plan(all_specs(), _recorded(), envvars.switch("M2OPS_COMPILE_ALL", None), subset)
    text = f"test_kernels_compile: building {p.describe()}"
    if p.full:
        text += (f". A run in which every part passes records those kernels' digests in tests/{RECORD.name}: commit "
                 f"that file with the kernel change, and CI builds only their quick sets (to record: "
                 f"{RECORD_COMMAND})")
    _announce(request, text)
    if p.full and not p.subset and p.why != "M2OPS_COMPILE_ALL=1":
        warnings.warn(text, UserWarning, stacklevel=1)
    yield p
    note = finish(p)
    if note:
        _announce(request, note)


@pytest.fixture(scope="module")
def pool():
    with cf.ProcessPoolExecutor(max_workers=_workers(), initializer=_worker_init) as executor:
        yield executor


def _build_part(plan: Plan, pool, part: str):
    arch, indices, what = plan.parts[part]
    if not indices:  # (nothing to build passes: a run limited to some kernels may leave a part empty)
        plan.passed.add(part)
        pytest.skip(f"{part}: nothing to build ({plan.why})")
    specs = plan.specs
    order = sorted(indices, key=lambda i: -_size(specs[i]))  # the longest builds first
    names = [specs[i].name for i in order]
    chunk = 1 if arch is not None else max(1, len(names) // (8 * _workers()))
    errors = [e for e in pool.map(_build, names, itertools.repeat(arch), chunksize=chunk) if e is not None]
    assert not errors, (f"{len(errors)} of {len(names)} specialisations ({what}) failed to build for "
                        f"{arch or 'the front end'}:\n" + "\n".join(errors)
                        + f"\n({len(specs)} specialisations in all; this run: the {plan.describe()})")
    plan.passed.add(part)


# ---------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------

def test_specialisations_are_enumerated():
    """Names are unique, every signature is well formed, and the specialised kernels are exactly the kernels
    that m2ops/kernels defines and the registry names (a kernel without specialisations would never be built here)."""
    import importlib

    import m2ops.kernels
    from m2ops.kernels.registry import KERNELS
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    defined = set()
    kdir = Path(m2ops.kernels.__file__).resolve().parent
    for path in (p for p in kdir.glob("*.py") if re.search(r"^@ct\.kernel\b", p.read_text(encoding="utf-8"), re.M)):
        module = importlib.import_module(f"{m2ops.kernels.__name__}.{path.stem}")
        defined |= {v._pyfunc.__name__ for v in vars(module).values()
                    if isinstance(v, ct.kernel) and v._pyfunc.__module__ == module.__name__}
    assert {s.wide_kernel._pyfunc.__name__ for s in specs} == defined
    assert {k._pyfunc.__name__ for k in KERNELS.values()} == defined
    for s in specs:
        s.signature()  # every signature is well formed for its kernel


def test_covering_sets_cover():
    """covering() leaves no value, or pair of values, of any kernel's features unbuilt."""
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    for indices, orders in ((_wide(specs), (1, 2)), (_narrow(specs), (1,))):
        for order in orders:
            chosen = covering(indices, order, specs)
            assert len(chosen) < len(indices)
            for name in {specs[i].kernel_name for i in indices}:
                def combos(idx):
                    return {c for i in idx if specs[i].kernel_name == name
                            for c in itertools.combinations(sorted(_features(specs[i])), order)}
                assert combos(chosen) == combos(indices), name


def test_quick_set_is_each_kernels_extremes():
    """The quick set builds, per kernel and architecture, exactly its largest and its smallest specialisation."""
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    quick = make_plan(specs, _digests(specs))
    for arch in ARCHS:
        chosen = quick.parts[arch][1]
        for name in {s.kernel_name for s in specs}:
            members = [i for i in _wide(specs) if specs[i].kernel_name == name]
            mine = [i for i in chosen if specs[i].kernel_name == name]
            sizes = [_size(specs[i]) for i in members]
            assert 1 <= len(mine) <= 2, (arch, name)
            assert {_size(specs[i]) for i in mine} == {max(sizes), min(sizes)}, (arch, name)


def test_plans_build_every_specialisation(tmp_path):
    """A full plan puts every specialisation through the front end at least (a cubin implies it), a quick plan
    every pair of feature values of each kernel (its cubins and its lowered specialisations together); every plan
    gives each architecture a cover of each kernel; a kernel whose digest is not recorded gets its full set; only
    a run in which every part passed records, and then the digests of the kernels it built in full, keeping the
    others'."""
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    digests = _digests(specs)
    cover = make_plan(specs, digests)
    full = make_plan(specs, {})
    assert not cover.full and full.changed == set(digests) and "holds no digest" in full.why
    assert make_plan(specs, dict(digests, chunk_cumsum="0" * 64)).changed == {"chunk_cumsum"}
    assert make_plan(specs, digests, forced=True).changed == set(digests)
    assert not make_plan(specs, {}, forced=False).full
    assert full.parts[FULL_ARCH][1] == _wide(specs)
    for p in (cover, full):
        assert set(p.parts) == {*ARCHS, NARROW, FRONT_END}
        cubins = set().union(*(ix for part, (_, ix, _) in p.parts.items() if part != FRONT_END))
        assert cubins.isdisjoint(p.parts[FRONT_END][1])
        if p is full:
            assert cubins | set(p.parts[FRONT_END][1]) == set(range(len(specs)))
        else:
            assert len(p.parts[FRONT_END][1]) < len(specs) // 3
            for name in {s.kernel_name for s in specs}:
                for narrow in (False, True):
                    def pairs(idx):
                        return {c for i in idx if specs[i].kernel_name == name and specs[i].narrow == narrow
                                for c in itertools.combinations(sorted(_features(specs[i])), 2)}
                    assert pairs(cubins | set(p.parts[FRONT_END][1])) == pairs(range(len(specs))), (name, narrow)
        for arch in ARCHS:
            assert {specs[i].kernel_name for i in p.parts[arch][1]} == {s.kernel_name for s in specs if not s.narrow}
    one = make_plan(specs, {}, subset=("chunk_cumsum",))
    assert {specs[i].kernel_name for _, ix, _ in one.parts.values() for i in ix} == {"chunk_cumsum"}
    assert one.changed == {"chunk_cumsum"}
    assert one.parts[FULL_ARCH][1] == [i for i in _wide(specs) if specs[i].kernel_name == "chunk_cumsum"]
    with pytest.raises(ValueError, match="no_such_kernel"):
        make_plan(specs, {}, subset=("no_such_kernel",))

    path = tmp_path / RECORD.name
    full.passed = set(full.parts) - {NARROW}
    assert "did not run or did not pass" in finish(full, path) and _recorded(path) == {}
    cover.passed = set(cover.parts)
    assert finish(cover, path) is None and _recorded(path) == {}
    one.passed = set(one.parts)
    assert "recorded" in finish(one, path) and _recorded(path) == {"chunk_cumsum": digests["chunk_cumsum"]}
    assert make_plan(specs, _recorded(path)).changed == set(digests) - {"chunk_cumsum"}
    full.passed = set(full.parts)
    assert "recorded" in finish(full, path) and _recorded(path) == digests
    assert not make_plan(specs, _recorded(path)).full
    path.write_text(path.read_text() + "f" * 64 + " removed_kernel\n")
    assert "removed_kernel" in _recorded(path) and not make_plan(specs, _recorded(path)).full


def test_digests_follow_the_kernel_sources():
    """Each kernel's digest covers its module, the kernel modules it imports and common.py, and changes with its
    specialisation list; another kernel's specialisations do not move it."""
    from m2ops.kernels.specs import all_specs
    import m2ops.kernels
    kdir = Path(m2ops.kernels.__file__).resolve().parent
    specs = all_specs()
    files = _kernel_files("state_update", kdir)
    assert {p.name for p in files} == {"state_update.py", "chunk_cumsum.py", "common.py", "index_width.py"}
    for s in {s.kernel_name: s for s in specs}.values():
        assert Path(inspect.getsourcefile(s.wide_kernel._pyfunc)).resolve() in _kernel_files(s.kernel_name, kdir)
    d = _digests(specs)
    assert d == _digests(list(reversed(specs)))
    fewer = _digests([s for s in specs if s is not next(t for t in specs if t.kernel_name == "chunk_cumsum")])
    assert fewer["chunk_cumsum"] != d["chunk_cumsum"]
    assert {n for n in d if fewer[n] != d[n]} == {"chunk_cumsum"}


@pytest.mark.parametrize("arch", ARCHS)
def test_specialisations_compile(arch, plan, pool):
    _build_part(plan, pool, arch)


def test_index32_twins_compile_for_sm_90(plan, pool):
    _build_part(plan, pool, NARROW)


def test_other_specialisations_lower(plan, pool):
    _build_part(plan, pool, FRONT_END)
