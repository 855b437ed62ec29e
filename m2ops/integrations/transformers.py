"""Run Hugging Face transformers' Mamba-2 models (Mamba2Model, Mamba2ForCausalLM, transformers 5.x) on m2ops.

    import m2ops.integrations.transformers as m2tf
    m2tf.patch()      # every Mamba2Mixer, existing or future, now scans and decodes through m2ops
    m2tf.unpatch()    # back to what transformers had

How: transformers' Mamba2Mixer.forward calls module-level functions of modeling_mamba2 — mamba2_chunk_scan,
mamba2_selective_state_update, causal_conv1d_fn, causal_conv1d_update, mamba2_split_conv1d_scan_combined —
each a wrapper that picks a hub kernel, mamba_ssm / causal_conv1d, or a PyTorch fallback when transformers is
imported. patch() replaces these module attributes (the mixer looks them up at call time), so it works
whatever transformers picked, on CPU and CUDA, and with or without the `kernels` package:

- mamba2_chunk_scan -> m2ops.mamba_chunk_scan_combined (prefill, and every forward without a cache);
- mamba2_selective_state_update -> m2ops.selective_state_update (one-token decoding), which updates the cache
  tensor in place, as transformers expects;
- causal_conv1d_fn -> m2ops.causal_conv1d_fn, which restarts at seq_idx / cu_seqlens boundaries;
- mamba2_split_conv1d_scan_combined (the fused training path) -> returns None, which the mixer reads as
  "no fused kernel" and continues with the unfused path, i.e. the three functions above.
causal_conv1d_update (the one-token convolution) is left as transformers has it.

Packed sequences: transformers' fallbacks refuse seq_idx / cu_seqlens without mamba_ssm. After patch() they
work through m2ops when passed to Mamba2Model's forward (it hands extra keyword arguments down to the mixer):
`model.backbone(input_ids, seq_idx=...)` or `cu_seqlens=...` (batch 1). Mamba2ForCausalLM.forward does not
pass extra keyword arguments to its backbone (they go to the loss), so packing needs the backbone call.
"""

from __future__ import annotations

import importlib

import torch.nn.functional as F

from ..conv1d import causal_conv1d_fn
from ..meta.validate import seq_idx_from_cu_seqlens
from ..ops.state_update_inplace import selective_state_update
from ..scan_combined import mamba_chunk_scan_combined

MODULE = "transformers.models.mamba2.modeling_mamba2"
_originals: dict[str, object] = {}


def chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, z=None, seq_idx=None, cu_seqlens=None,
               **kwargs):
    """transformers' mamba2_chunk_scan signature on m2ops; other keyword arguments (the model's **kwargs) are
    ignored, as transformers' wrapper drops those its implementation does not take."""
    return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, int(chunk_size), D=D, z=z, dt_bias=dt_bias,
                                     initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                                     dt_softplus=dt_softplus, dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
                                     return_final_states=return_final_states)


def state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """transformers' mamba2_selective_state_update on m2ops: returns y and updates `state` in place.

    No dt_limit here, as in transformers' own decode path (its chunked path applies config.time_step_limit,
    its decode path does not); with dt_softplus the default clamp at 0 changes nothing."""
    return selective_state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)


def conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, cu_seqlens=None, **kwargs):
    """transformers' causal_conv1d_fn (hidden_states (batch, channels, seqlen)) on m2ops.causal_conv1d_fn, which
    does not let a tap cross a packed-sequence boundary. With a cache transformers prepends the cached inputs;
    those count as sequence 0 (the rule m2ops uses for initial states)."""
    L = hidden_states.shape[-1]
    if seq_idx is None and cu_seqlens is not None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, L)
    if seq_idx is not None and seq_idx.shape[-1] < L:
        seq_idx = F.pad(seq_idx, (L - seq_idx.shape[-1], 0))
    if activation in (None, "silu", "swish"):
        return causal_conv1d_fn(hidden_states, weight, bias, seq_idx, activation=activation)
    from transformers.activations import ACT2FN
    return ACT2FN[activation](causal_conv1d_fn(hidden_states, weight, bias, seq_idx))


def split_conv1d_scan_combined(*args, **kwargs):
    """No fused split-conv-scan: None sends the mixer down its unfused path (which patch() also routes to
    m2ops), the same contract transformers' own fallback has."""
    return None


_REPLACEMENTS = {
    "mamba2_chunk_scan": chunk_scan,
    "mamba2_selective_state_update": state_update,
    "causal_conv1d_fn": conv1d_fn,
    "mamba2_split_conv1d_scan_combined": split_conv1d_scan_combined,
}


def _module():
    return importlib.import_module(MODULE)


def patch():
    """Route transformers' Mamba2 mixers through m2ops. Idempotent; affects models built before and after."""
    mod = _module()
    missing = [name for name in _REPLACEMENTS if not hasattr(mod, name)]
    if missing:
        raise RuntimeError(f"m2ops.integrations.transformers.patch: {MODULE} has no {', '.join(missing)}; this "
                           "transformers version is not supported (transformers 5.x is)")
    if _originals:
        return
    for name, fn in _REPLACEMENTS.items():
        _originals[name] = getattr(mod, name)
        setattr(mod, name, fn)


def unpatch():
    """Put back the functions patch() replaced. Does nothing when not patched."""
    if not _originals:
        return
    mod = _module()
    for name, fn in _originals.items():
        setattr(mod, name, fn)
    _originals.clear()


def is_patched() -> bool:
    return bool(_originals)


class patched:
    """Context manager: patch() on entry, unpatch() on exit (unless it was already patched before)."""

    def __enter__(self):
        self._was = is_patched()
        patch()
        return self

    def __exit__(self, *exc):
        if not self._was:
            unpatch()
        return False


__all__ = ["patch", "unpatch", "is_patched", "patched", "chunk_scan", "state_update", "conv1d_fn",
           "split_conv1d_scan_combined"]
