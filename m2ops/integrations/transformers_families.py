"""Which transformers model families run Mamba-2 mixers, found by what their modeling modules define.

A family is a module transformers/models/<name>/modeling_<name>.py that defines one of transformers' Mamba-2 helper
functions (mamba2_chunk_scan, mamba2_selective_state_update, mamba2_split_conv1d_scan_combined): its mixer calls
those and causal_conv1d_fn / causal_conv1d_update by module-level name, so replacing the module attributes routes
every mixer of the family, built before or after. Files are searched as text first (cheap), and only the
matching modules are imported.

Each family is checked against what m2ops replaces: all five functions present with the parameters (names, kinds,
defaults) of the m2ops adapters (transformers_adapters.py), which copy transformers' 5.x signatures. A family
that does not match is reported by name and is not patched. Its gated-norm classes (*RMSNormGated) are checked by
constructor parameters and by running them once on a tiny input against m2ops; one that does not match keeps its
own forward (a warning says so), since the norm is not needed for the scan and decode to run through m2ops.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import torch

from .transformers_adapters import FUNCTIONS, NORM_FORWARDS

# Names only a Mamba-2 module defines (causal_conv1d_fn and causal_conv1d_update are shared with Mamba-1, GDN,
# ShortConv ... families, which m2ops does not patch).
MARKERS = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined")
_MARKER_RE = re.compile(r"\b(" + "|".join(MARKERS) + r")\b")


@dataclasses.dataclass
class Family:
    """One transformers model family with Mamba-2 mixers and what patch() replaces in it."""
    name: str                      # the models/ folder name: "mamba2", "bamba", "falcon_h1", ...
    module: object                 # transformers.models.<name>.modeling_<name>
    problems: list[str]            # why its functions do not match m2ops (empty: they do)
    norm_classes: dict[str, object]  # gated-norm class name -> the m2ops forward that replaces its forward
    norm_problems: list[str]       # gated-norm classes left on their own forward, and why

    @property
    def module_name(self) -> str:
        return self.module.__name__

    def error(self) -> str:
        import transformers
        return (f"the {self.name} family ({self.module_name}, transformers {transformers.__version__}) no longer "
                f"matches what m2ops replaces: {'; '.join(self.problems)}")


def _parameters(obj):
    """(name, kind, default) of a callable's parameters. transformers wraps each helper (functools.wraps, so
    inspect follows __wrapped__ to the original); with the `kernels` package installed the module attribute is an
    nn.Module instance whose class forward carries the signature, self first."""
    if isinstance(obj, torch.nn.Module):
        params = list(inspect.signature(type(obj).forward).parameters.values())[1:]
    else:
        params = list(inspect.signature(obj).parameters.values())
    return [(p.name, p.kind, p.default) for p in params]


def _describe(params) -> str:
    out = []
    for name, kind, default in params:
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(kind, "")
        out.append(prefix + name + ("" if default is inspect.Parameter.empty else f"={default!r}"))
    return "(" + ", ".join(out) + ")"


def _function_problems(module) -> list[str]:
    problems = []
    for name, adapter in FUNCTIONS.items():
        if not hasattr(module, name):
            problems.append(f"it has no {name}")
            continue
        try:
            got = _parameters(getattr(module, name))
        except (TypeError, ValueError) as e:
            problems.append(f"{name}'s signature cannot be read ({e})")
            continue
        want = _parameters(adapter)
        if got != want:
            problems.append(f"{name} takes {_describe(got)} where m2ops replaces {_describe(want)}")
    return problems


def _norm_matches(cls, forward, init_params) -> str | None:
    """Run the class's own forward and the m2ops one on tiny float32 inputs (every option the constructor has;
    transformers computes the norm in float32 whatever the input); None when they agree, else why not."""
    hidden = 8
    if "group_size" in init_params:
        variants = [{"group_size": 4}]
    else:
        variants = [{"n_groups": 2, "norm_before_gate": before} for before in (False, True)]
    g = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(2, 3, hidden, generator=g) for _ in range(2))
    for options in variants:
        try:
            norm = cls(hidden_size=hidden, eps=1e-5, **options)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(hidden, generator=g))
                want = cls.forward(norm, x, gate)
                got = forward(norm, x, gate)
        except Exception as e:  # noqa: BLE001 - any failure means "does not match"
            return f"running it with {options} failed ({type(e).__name__}: {e})"
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"with {options} its forward computes something else than m2ops.rms_norm_gated"
    return None


def _norm_classes(module):
    found, problems = {}, []
    for attr, cls in sorted(vars(module).items()):
        if not (inspect.isclass(cls) and attr.endswith("RMSNormGated") and cls.__module__ == module.__name__
                and issubclass(cls, torch.nn.Module)):
            continue
        init_params = tuple(inspect.signature(cls.__init__).parameters)[1:]
        forward = NORM_FORWARDS.get(init_params)
        why = (f"its constructor takes {init_params}, which m2ops does not know" if forward is None
               else _norm_matches(cls, forward, init_params))
        if why is None:
            found[attr] = forward
        else:
            problems.append(f"{attr}: {why}")
    return found, problems


def _candidate_modules() -> list[str]:
    spec = importlib.util.find_spec("transformers.models")
    names = []
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).glob("*/modeling_*.py")):
            text = path.read_text(encoding="utf-8", errors="ignore")
            if "mamba2_" in text and _MARKER_RE.search(text):
                names.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return names


@functools.lru_cache(maxsize=None)
def discover() -> tuple[Family, ...]:
    """Every family of the installed transformers with Mamba-2 helper functions, checked (once per process: the
    checks read the functions transformers defined, before any patch)."""
    families = []
    for module_name in _candidate_modules():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a module that cannot be imported here has no model to patch either
            continue
        if not any(hasattr(module, m) for m in MARKERS):
            continue
        norms, norm_problems = _norm_classes(module)
        families.append(Family(module_name.split(".")[2], module, _function_problems(module), norms, norm_problems))
    return tuple(families)


def select(names=None) -> list[Family]:
    """The families named (all when None); an unknown name raises ValueError listing the known ones."""
    families = {f.name: f for f in discover()}
    if names is None:
        return list(families.values())
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in families]
    if unknown:
        raise ValueError(f"m2ops.integrations.transformers: families must name families of the installed "
                         f"transformers with Mamba-2 mixers ({', '.join(families) or 'none found'}); got "
                         f"{', '.join(map(repr, unknown))}")
    return [families[n] for n in names]
