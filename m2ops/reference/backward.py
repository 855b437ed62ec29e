"""Vector-Jacobian products of a reference forward (torch.func.vjp), recomputing it.

Only m2ops::state_update_bwd uses this now; the three scan ops run the explicit formulas of
chunked_backward.py. Delete this module, with its private-dispatcher guard, once state_update has explicit
backward formulas too. torch.func works inside a custom op's implementation, where the dispatcher has already
stepped below autograd.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


_FUNCTORCH_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchGradWrapper", "FuncTorchBatched",
    "FuncTorchVmapMode"))


def _functorch_enabled():
    """A guard that un-excludes functorch's dispatch keys. When the op is called from inside a
    TorchDispatchMode (FlopCounterMode, opcheck, torch.compile's first-call aliasing check), the dispatcher
    excludes every key above Python, and torch.func would fail on its storage-less wrapper tensors."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _FUNCTORCH_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def reference_vjp(fn: Callable, args: Sequence, wrt: Sequence[int], cotangents):
    """Gradients of fn(*args) with respect to args[i] for i in wrt, given the output cotangents.

    An absent (None) argument gets an empty tensor, the op schemas' stand-in for "no gradient". Results
    never alias an input: custom ops may not return their inputs.
    """
    present = [i for i in wrt if args[i] is not None]

    def f(*primals):
        full = list(args)
        for i, t in zip(present, primals):
            full[i] = t
        return fn(*full)

    with _functorch_enabled():
        primal_out, pullback = torch.func.vjp(f, *(args[i] for i in present))
        # The cotangents must have the output's pytree structure: a bare tensor for a single-tensor output.
        got = dict(zip(present, pullback(tuple(cotangents) if isinstance(primal_out, tuple) else cotangents[0])))
    taken = {t.untyped_storage().data_ptr() for t in (*args, *cotangents) if isinstance(t, torch.Tensor)}
    out = []
    for i in wrt:
        if i not in got:
            out.append(cotangents[0].new_empty((0,)))
            continue
        g = got[i].contiguous()  # the fake implementations promise contiguous gradients
        out.append(g.clone() if g.untyped_storage().data_ptr() in taken else g)
    return tuple(out)
