"""The reference backward: vector-Jacobian products of the chunked forward (torch.func.vjp), recomputing it.

This is the backward of every op on the fallback path. torch.func works inside a custom op's
implementation, where the dispatcher has already stepped below autograd.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


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

    _, pullback = torch.func.vjp(f, *(args[i] for i in present))
    got = dict(zip(present, pullback(cotangents)))
    taken = {t.untyped_storage().data_ptr() for t in (*args, *cotangents) if isinstance(t, torch.Tensor)}
    out = []
    for i in wrt:
        if i not in got:
            out.append(cotangents[0].new_empty((0,)))
            continue
        g = got[i]
        out.append(g.clone() if g.untyped_storage().data_ptr() in taken else g)
    return tuple(out)
