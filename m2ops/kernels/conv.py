"""Launchers of the causal convolution's kernels (conv1d.py, conv1d_bwd.py, conv1d_update.py): the CUDA
implementations of m2ops::causal_conv1d, m2ops::causal_conv1d_bwd and m2ops::causal_conv1d_update, with the
reference functions' signatures (m2ops/reference/conv1d.py).

The kernels read x and g_y through their (batch, seqlen, channels) views with channels contiguous: the layer's x,
a transposed view of the input projection's output, is taken as it is; any other layout is copied to that one
first. y and g_x are written channel-last (meta.conv1d.conv_output). weight, bias and the states are small and read
in float32 (converted when they are not; the decode update also takes weight and bias in x's dtype as they are,
runtime.param_dtype); seq_idx in int32. The history (initial_states) and its gradient travel as
channel-last float32 (batch, HALO, channels) arrays, the W-1 entries last, which the launcher builds and unpacks
(a few KB): the kernels then read and write the history like any other halo rows.
"""

from __future__ import annotations

import torch

from . import runtime
from .common import cdiv
from .conv1d import HALO
from .runtime import as_dtype, dense, dtype_name, dummy, param_dtype
from .specialise import hinted_kernel
from ..meta.conv1d import KERNEL_MAX_STATE_LEN, KERNEL_WIDTHS, conv_output

# Forward: (BT tokens, BC channels) per program, each tap's operand gathered at shifted token rows (conv1d.py).
# Measured at 8 x 4096 x 5376, bfloat16, width 4 on an H200 (measure/conv_variants.py, 2026-12-07): 16 x 64 at
# occupancy 8 (specialise's table) 0.538 ms, 8 x 128 at occupancy 8 0.564, 16 x 128 at occupancy 4 0.592 and
# without a hint 0.965, 32 x 128 at occupancy 2 0.883; bandwidth bound 0.210, mamba_ssm's causal-conv1d 0.282 (H100).
CONV_TILE_T = 16
CONV_TILE_C = 64
# Backward: fewer tokens per tile (x, g_y, u and du rows with a halo on either side). As the runtime builds it with
# SiLU (bfloat16, width 4): 255 registers and 4.7 KB of spills at occupancy 2; 0.930 ms at 8 x 4096 x 5376 on an
# H100 against a 0.316 ms bound (2026-12-07). Programs walk segments of token tiles so that the partial sums of
# g_weight and g_bias are few: about CONV_BWD_PROGRAMS_PER_SM programs per SM.
CONV_BWD_TILE_T = 16
CONV_BWD_TILE_C = 128
CONV_BWD_PROGRAMS_PER_SM = 4
# Decode: BC channels per program, the state in one tile of KERNEL_MAX_STATE_LEN entries (64 registers).
UPDATE_TILE_C = 128


def conv_constants(width: int) -> dict:
    """The forward's constants at a width of KERNEL_WIDTHS (the ops run the reference at others)."""
    assert width in KERNEL_WIDTHS, width
    return dict(W=width, BT=CONV_TILE_T, BC=CONV_TILE_C)


def conv_bwd_constants(width: int, silu: bool) -> dict:
    return dict(W=width, BT=CONV_BWD_TILE_T, BC=CONV_BWD_TILE_C, ACT=bool(silu))


def update_constants() -> dict:
    return dict(SP=KERNEL_MAX_STATE_LEN, BC=UPDATE_TILE_C)


def update_state_dtypes(act_dtype: str) -> tuple:
    """conv_state dtypes the update kernel is built for, given the activations' dtype: that dtype or float32 (a
    cache kept in the activations' dtype, or a float32 one). Others run the reference (ops/conv1d.py)."""
    return (act_dtype,) if act_dtype == "float32" else (act_dtype, "float32")


def _channel_last(t):
    """(batch, channels, seqlen) t as its (batch, seqlen, channels) view with unit channel stride (copied to that
    layout when it is not)."""
    v = t.transpose(1, 2)
    if v.stride(2) != 1 and v.shape[2] > 1:
        v = v.contiguous()
    return dense(v)


def _history(initial_states, like, width: int):
    """initial_states (batch, channels, W-1) as float32 (batch, HALO, channels), the entries last."""
    b, c, _ = initial_states.shape
    h = torch.zeros((b, HALO, c), dtype=torch.float32, device=like.device)
    h[:, HALO - (width - 1):, :] = initial_states.transpose(1, 2)
    return h


def _optional(t, dtype, like, ndim):
    return as_dtype(t, dtype) if t is not None else dummy(like, dtype, ndim)


def causal_conv1d(x, weight, bias, seq_idx, initial_states, silu: bool, final_state_len: int):
    """m2ops::causal_conv1d on the GPU: (y channel-last like meta.conv1d.conv_output, final states (b, c, S)
    contiguous in x's dtype). One launch (plus the small conversions above); no host synchronisation."""
    b, c, L = x.shape
    W = weight.shape[1]
    S = final_state_len
    k = conv_constants(W)
    y = conv_output(x)
    fin = torch.empty((b, S, c), dtype=x.dtype, device=x.device) if S > 0 else dummy(x, x.dtype, 3)
    hist = _history(initial_states, x, W) if initial_states is not None else dummy(x, torch.float32, 3)
    kernel = hinted_kernel("causal_conv1d", dtype_name(x.dtype), 0)
    runtime.launch((cdiv(L, k["BT"]), cdiv(c, k["BC"]), b), kernel,
                   (_channel_last(x), as_dtype(weight, torch.float32), _optional(bias, torch.float32, x, 1),
                    _optional(seq_idx, torch.int32, x, 2), hist, y.transpose(1, 2), fin,
                    L, int(bias is not None), int(seq_idx is not None), int(initial_states is not None),
                    int(bool(silu)), S, k["W"], k["BT"], k["BC"]))
    final = fin.transpose(1, 2).contiguous() if S > 0 else x.new_empty((b, c, 0))
    return y, final


def backward_segments(batch: int, channel_tiles: int, token_tiles: int, device) -> tuple[int, int]:
    """(segments, tiles per segment) of the backward: about CONV_BWD_PROGRAMS_PER_SM programs per SM over
    (segments, channel tiles, batch rows), each segment at least one token tile."""
    want = CONV_BWD_PROGRAMS_PER_SM * runtime.sm_count(device)
    segs = max(1, min(token_tiles, cdiv(want, batch * channel_tiles)))
    per = cdiv(token_tiles, segs)
    return cdiv(token_tiles, per), per


def _add_final_grad(gx, g_init32, g_final, seq_idx, L: int, W: int):
    """The final states copy the last S inputs (history included): their gradient goes back to those inputs, where
    the reference's masks kept them. gx: (b, c, L) in x's dtype; g_init32: float32 (b, c, W-1) or None."""
    b, c, S = g_final.shape
    g = g_final.to(torch.float32)
    if seq_idx is not None:
        ids = torch.cat([seq_idx.new_zeros(b, S + W - 1), seq_idx], dim=1)[:, -S:]
        g = g * (ids == seq_idx[:, -1:]).unsqueeze(1)
    m = min(S, L)
    gx[..., L - m:] += g[..., S - m:].to(gx.dtype)
    n = min(S - m, W - 1)
    if g_init32 is not None and n > 0:
        g_init32[..., W - 1 - n:] += g[..., S - m - n:S - m]


def causal_conv1d_bwd(g_y, g_final, x, weight, bias, seq_idx, initial_states, silu: bool):
    """m2ops::causal_conv1d_bwd on the GPU: (g_x channel-last, g_weight, g_bias, g_initial_states), the absent
    ones empty. One launch, then the sums of the per-program partials (and the final states' gradient, when
    there are final states)."""
    b, c, L = x.shape
    W = weight.shape[1]
    k = conv_bwd_constants(W, silu)
    n_tiles, n_ctiles = cdiv(L, k["BT"]), cdiv(c, k["BC"])
    segs, per = backward_segments(b, n_ctiles, n_tiles, x.device)
    f32 = torch.float32
    g_x = conv_output(x)
    g_w_part = torch.empty((b * segs, W, c), dtype=f32, device=x.device)
    g_b_part = torch.empty((b * segs, c), dtype=f32, device=x.device) if bias is not None else dummy(x, f32, 2)
    g_hist = torch.empty((b, HALO, c), dtype=f32, device=x.device) if initial_states is not None else dummy(x, f32, 3)
    hist = _history(initial_states, x, W) if initial_states is not None else dummy(x, f32, 3)
    kernel = hinted_kernel("causal_conv1d_bwd", dtype_name(x.dtype), 0)
    runtime.launch((segs, n_ctiles, b), kernel,
                   (_channel_last(x), _channel_last(as_dtype(g_y, x.dtype)), as_dtype(weight, f32),
                    _optional(bias, f32, x, 1), _optional(seq_idx, torch.int32, x, 2), hist,
                    g_x.transpose(1, 2), g_w_part, g_b_part, g_hist,
                    L, per, segs, int(bias is not None), int(seq_idx is not None), int(initial_states is not None),
                    k["W"], k["BT"], k["BC"], k["ACT"]))
    # (.to() of a tensor already in the dtype returns it as it is: hence contiguous() before it)
    g_init32 = g_hist[:, HALO - (W - 1):, :].transpose(1, 2).contiguous() if initial_states is not None else None
    if g_final.shape[-1] > 0:
        _add_final_grad(g_x, g_init32, g_final, seq_idx, L, W)
    g_w = g_w_part.sum(0).t().contiguous().to(weight.dtype)
    g_bias = g_b_part.sum(0).to(bias.dtype) if bias is not None else g_y.new_empty((0,))
    g_init = g_init32.to(initial_states.dtype) if initial_states is not None else g_y.new_empty((0,))
    return g_x, g_w, g_bias, g_init


def causal_conv1d_update(x, conv_state, weight, bias, silu: bool, conv_state_indices):
    """m2ops::causal_conv1d_update on the GPU: y (b, c) like x; conv_state written in place (in its own dtype and
    layout). One launch, no host synchronisation (CUDA-graph capturable)."""
    b, c = x.shape
    k = update_constants()
    y = torch.empty((b, c), dtype=x.dtype, device=x.device)
    kernel = hinted_kernel("causal_conv1d_update", dtype_name(x.dtype), 0)
    pd = param_dtype(x.dtype, weight, bias)
    runtime.launch((cdiv(c, k["BC"]), b, 1), kernel,
                   (dense(x), conv_state, as_dtype(weight, pd), _optional(bias, pd, x, 1),
                    _optional(conv_state_indices, torch.int32, x, 1), y,
                    conv_state.shape[2], weight.shape[1], int(bias is not None), int(conv_state_indices is not None),
                    int(bool(silu)), k["SP"], k["BC"]))
    return y
