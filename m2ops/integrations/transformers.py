"""Run Hugging Face transformers' Mamba-2 model families on m2ops (transformers 5.x): Mamba2, Bamba, FalconH1,
GraniteMoeHybrid (Granite 4.0), NemotronH, Zamba2 -- every family whose modeling module defines transformers'
Mamba-2 helpers, found in the installed transformers (families()).

Two ways in (docs/models.md says when to use which):

    import m2ops.integrations.transformers as m2tf
    m2tf.patch()                  # every mixer of every family, built before or after, on m2ops
    m2tf.unpatch()                # back to what transformers had
    with m2tf.patched(): ...      # for a block

    m2tf.kernelize(model)         # one model instance, through the `kernels` package's kernel mapping
    # = with kernels.use_kernel_mapping(m2tf.kernel_mapping()): kernels.kernelize(model, mode=...)

What runs where (both ways): prefill and every forward without a cache -> m2ops.mamba_chunk_scan_combined and
m2ops.causal_conv1d_fn (seq_idx / cu_seqlens passed to the model's forward keep packed sequences apart); one-token
decoding -> m2ops.selective_state_update and m2ops.causal_conv1d_update, both in place on the cache's tensors; the
fused training call -> "no fused kernel", so training runs the same differentiable m2ops ops. patch() also routes
the families' gated norms (*RMSNormGated.forward) to m2ops.rms_norm_gated (the kernel mapping has no name for
them). How: the mixers look the helpers up by module-level name at call time, so patch() replaces those module
attributes (and the norm classes' forward); signatures are checked first (transformers_families.py).
"""

from __future__ import annotations

import warnings

from .transformers_adapters import (FUNCTIONS, chunk_scan, conv1d_fn, conv1d_update, split_conv1d_scan_combined,
                                    state_update)
from .transformers_families import Family, discover, select
from .transformers_kernels import M2opsRepository, kernel_mapping, kernelize, routed

_MISSING = object()
# family name -> [(owner, attribute, what was there before)] for unpatch().
_saved: dict[str, list[tuple[object, str, object]]] = {}


def families() -> tuple[Family, ...]:
    """The installed transformers' families with Mamba-2 mixers, each with .problems (empty when patch() can
    route it), .norm_classes (the gated norms patch() routes) and .norm_problems."""
    return discover()


def patch(families=None) -> list[str]:
    """Route the Mamba-2 mixers of the named families (default: all found) through m2ops; returns the names.

    Idempotent; affects models built before and after. Raises RuntimeError naming each selected family whose
    functions no longer match what m2ops replaces, before patching anything (pass families=[...] to patch the
    others); ValueError for an unknown family name."""
    selected = select(families)
    if not selected:
        import transformers
        raise RuntimeError(f"m2ops.integrations.transformers.patch: transformers {transformers.__version__} has no "
                           "model family with Mamba-2 helpers (mamba2_chunk_scan ...)")
    bad = [f for f in selected if f.problems]
    if bad:
        good = [f.name for f in selected if not f.problems]
        raise RuntimeError("m2ops.integrations.transformers.patch: " + " / ".join(f.error() for f in bad)
                           + (f". patch(families={good!r}) patches the others" if good else ""))
    for family in selected:
        if family.name not in _saved:
            _saved[family.name] = _patch_family(family)
    return [f.name for f in selected]


def _patch_family(family: Family) -> list[tuple[object, str, object]]:
    for problem in family.norm_problems:
        warnings.warn(f"m2ops.integrations.transformers.patch: the {family.name} family's gated norm stays on "
                      f"transformers' own forward: {problem}", stacklevel=3)
    saved = []
    for name, adapter in FUNCTIONS.items():
        saved.append((family.module, name, getattr(family.module, name)))
        setattr(family.module, name, adapter)
    for cls_name, forward in family.norm_classes.items():
        cls = getattr(family.module, cls_name)
        saved.append((cls, "forward", cls.__dict__.get("forward", _MISSING)))
        cls.forward = forward
    return saved


def unpatch(families=None) -> None:
    """Put back what patch() replaced in the named families (default: all patched). Nothing when not patched."""
    names = list(_saved) if families is None else [f.name for f in select(families)]
    for name in names:
        for owner, attr, original in reversed(_saved.pop(name, [])):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def is_patched(family: str | None = None) -> bool:
    """Whether patch() is in force (for `family`, or for any)."""
    return family in _saved if family is not None else bool(_saved)


class patched:
    """Context manager: patch(families) on entry; on exit, unpatch() of the families it patched itself."""

    def __init__(self, families=None):
        self._families = families

    def __enter__(self):
        before = set(_saved)
        self._ours = [n for n in patch(self._families) if n not in before]
        return self

    def __exit__(self, *exc):
        if self._ours:
            unpatch(self._ours)
        return False


__all__ = ["patch", "unpatch", "is_patched", "patched", "families", "Family", "kernel_mapping", "kernelize",
           "routed", "M2opsRepository", "chunk_scan", "state_update", "conv1d_fn", "conv1d_update",
           "split_conv1d_scan_combined"]
