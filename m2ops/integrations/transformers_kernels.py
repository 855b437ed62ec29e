"""m2ops through transformers' own kernel mechanism: the `kernels` package's kernel mapping.

transformers decorates its Mamba-2 helpers with use_kernel_func_from_hub_with_fallback(<layer name>, ...): with
`kernels` installed (transformers 5.24 enables it for kernels >= 0.18.2, < 0.19) each helper is an nn.Module
whose forward `kernelize` can replace per model instance, looking the layer name up in a kernel mapping
{layer name: {device: repository}}. A repository is anything with load() returning a stateless nn.Module class
whose forward has the helper's parameters. M2opsRepository is such an object: it loads from m2ops, not the Hub.

    from kernels import Mode, kernelize, use_kernel_mapping
    with use_kernel_mapping(m2tf.kernel_mapping()):
        kernelize(model, mode=Mode.INFERENCE)        # or m2tf.kernelize(model)

The layer names are shared by every family decorated with them, so a kernelized Mamba-1 model (Mamba,
FalconMamba, Jamba, Zamba) or a model with causal convolutions (Qwen3-Next, LFM2, ...) gets m2ops's convolution
too (causal-conv1d's semantics, which the Hub kernel it stands for has); a decode call with a Mamba-1 state
(batch, dim, dstate) goes to the model's own implementation, which m2ops does not replace.
"""

from __future__ import annotations

import logging
import warnings

import torch

from . import transformers_adapters as adapt

_INF = float("inf")


class ChunkScan(torch.nn.Module):
    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, _INF), return_final_states=False, **kwargs):
        return adapt.chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus,
                                dt_limit, return_final_states, **kwargs)


class StateUpdate(torch.nn.Module):
    can_torch_compile = True
    has_backward = False  # decoding into a cache: under Mode.TRAINING kernelize keeps transformers' own

    def forward(self, state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None,
                **kwargs):
        if state.dim() != 4:  # Mamba-1's (batch, dim, dstate) state: not a Mamba-2 decode, the model's own
            return type(self).forward(self, state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, **kwargs)
        return adapt.state_update(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, **kwargs)


class Conv1dFn(torch.nn.Module):
    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        return adapt.conv1d_fn(hidden_states, weight, bias, activation, **kwargs)


class Conv1dUpdate(torch.nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, conv_state, weight, bias=None, activation=None):
        return adapt.conv1d_update(hidden_states, conv_state, weight, bias, activation)


class SplitConv1dScanCombined(torch.nn.Module):
    can_torch_compile = True
    has_backward = True

    def forward(self, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                dt_limit=(0.0, _INF), return_final_states=False, activation="silu", rmsnorm_weight=None,
                rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
                norm_before_gate=True, **kwargs):
        return None  # the mixer's unfused path, through the layers above (see adapt.split_conv1d_scan_combined)


# transformers' layer names (the first argument of use_kernel_func_from_hub_with_fallback) -> m2ops layer.
LAYERS = {
    "mamba_chunk_scan_combined": ChunkScan,
    "selective_state_update": StateUpdate,
    "causal_conv1d_fn": Conv1dFn,
    "causal_conv1d_update": Conv1dUpdate,
    "mamba_split_conv1d_scan_combined": SplitConv1dScanCombined,
}


class M2opsRepository:
    """A kernel repository for `kernels` (its RepositoryProtocol) that loads an m2ops layer: nothing is
    downloaded. Equal repositories (same layer name) share kernels' cache of loaded layers."""

    def __init__(self, layer_name: str):
        if layer_name not in LAYERS:
            raise ValueError(f"M2opsRepository: layer_name must be one of {', '.join(LAYERS)}; got {layer_name!r}")
        self.layer_name = layer_name

    def load(self) -> type[torch.nn.Module]:
        return LAYERS[self.layer_name]

    def __eq__(self, other):
        return isinstance(other, M2opsRepository) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash(("m2ops", self.layer_name))

    def __str__(self):
        return f"m2ops ({self.layer_name})"

    __repr__ = __str__


def kernel_mapping(devices=("cuda", "cpu")) -> dict:
    """The kernel mapping that routes transformers' Mamba-2 helpers to m2ops, for kernels' use_kernel_mapping /
    register_kernel_mapping: {layer name: {device: M2opsRepository}} for every device type in `devices` (m2ops runs
    its cuTile kernels on "cuda" and its PyTorch reference on "cpu"). Needs no `kernels` import itself."""
    if isinstance(devices, str):
        devices = (devices,)
    bad = [d for d in devices if d not in ("cuda", "cpu")]
    if bad:
        raise ValueError(f"kernel_mapping: devices must be 'cuda' and/or 'cpu' (where m2ops runs); got {bad}")
    return {name: {device: M2opsRepository(name) for device in devices} for name in LAYERS}


def kernelize(model, mode=None, device=None):
    """kernels.kernelize(model) with kernel_mapping() in force: every Mamba-2 helper of this model instance runs
    through m2ops (other models are untouched). mode: a kernels.Mode, by default INFERENCE or TRAINING as
    model.training says. Mappings registered before for other layers stay in force. Returns the model."""
    try:
        import kernels
    except ImportError as e:
        raise ImportError("m2ops.integrations.transformers.kernelize needs the `kernels` package (transformers "
                          "enables it for the versions its KERNELS_MIN_VERSION/KERNELS_MAX_VERSION give); "
                          "patch() works without it") from e
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION, is_kernels_available
    if not is_kernels_available():
        raise ImportError(f"m2ops.integrations.transformers.kernelize: transformers uses `kernels` only for "
                          f"{KERNELS_MIN_VERSION} <= version < {KERNELS_MAX_VERSION}; installed: "
                          f"{getattr(kernels, '__version__', '?')}. patch() works with any")
    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    # kernels logs a warning for every other decorated layer of the model (RMSNorm, rotary_pos_emb ...) that no
    # mapping names; those keep their forward, as they would without this call.
    log, quiet = logging.getLogger("kernels.layer.layer"), _NoMappingFilter()
    log.addFilter(quiet)
    try:
        with kernels.use_kernel_mapping(kernel_mapping()):
            kernels.kernelize(model, mode=mode, device=device, use_fallback=True)
    finally:
        log.removeFilter(quiet)
    if not routed(model):
        warnings.warn("m2ops.integrations.transformers.kernelize: no helper of this model runs through m2ops (it "
                      "has no transformers Mamba-2 / causal-conv1d helper, or transformers was imported before "
                      "`kernels` could be)", stacklevel=2)
    return model


class _NoMappingFilter(logging.Filter):
    def filter(self, record):
        return "No kernel mapping found" not in record.getMessage()


def routed(model) -> list[str]:
    """The helpers of this model instance that kernelize routed to m2ops, as 'module path: layer name'."""
    out = []
    for path, module in model.named_modules():
        for fn in getattr(module, "_kernel_funcs", {}).values():
            repo = fn.__dict__.get("_kernel_repo")
            if isinstance(repo, M2opsRepository):
                out.append(f"{path}: {repo.layer_name}")
    return out
