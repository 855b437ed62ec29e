"""Programmatic dependent launch (launch.PDL): which kernels take it, that each of them waits for the kernel
before it ahead of any memory access, and the environment variable that turns it off."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

from conftest import printed_with_env  # noqa: E402
from m2ops.kernels import launch, specs  # noqa: E402


def _body(kernel):
    fn = ast.parse(textwrap.dedent(inspect.getsource(kernel._pyfunc))).body[0]
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    return body


def _first_call(kernel) -> str:
    first = _body(kernel)[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) and isinstance(first.value.func, ast.Name):
        return first.value.func.id
    return ast.dump(first)[:80]


def test_every_dependent_kernel_waits_first():
    """A kernel launched with PDL may start while its predecessor still runs: its first statement must be the
    wait (common.dependent_launch_prologue), before any load or store. The kernels with an EARLY constant wait
    first when it is 0 (test_early_loads_read_only_inputs has the other values)."""
    kernels = {k._pyfunc.__name__: k for k in specs._KERNELS.values()}
    assert launch.PDL_KERNELS <= set(kernels)
    for name in sorted(launch.PDL_KERNELS):
        if name in _EARLY_KERNELS:
            first = _body(kernels[name])[0]
            assert isinstance(first, ast.If) and ast.unparse(first.test) == "EARLY == 0", name
            assert ast.unparse(first.body[0]) == "dependent_launch_prologue()", name
            continue
        assert _first_call(kernels[name]) == "dependent_launch_prologue", name


# Kernels whose EARLY constant lets them read some arrays before the wait, and those arrays: the call's inputs
# (seq_idx as converted before the call's first launch), which no kernel of the forward writes (launch.OUT_EARLY,
# launch.STATE_EARLY).
_EARLY_KERNELS = {"compute_out_carry_kernel": {"x", "C", "B", "seq_idx"},
                  "chunk_state_kernel": {"x", "B"},
                  # and the walk, which the launcher lets go early only where C . B^T and the cumulative sums come
                  # from a launch before the one before it (launch.WALK_EARLY); never the states
                  "compute_out_kernel": {"x", "seq_idx", "cb", "dA_cumsum", "dt_out"}}


def _test_value(test, early):
    """The value of an `if` test on EARLY alone (EARLY == k, EARLY != k) at EARLY = early, else None."""
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "EARLY"
            and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant)):
        k = test.comparators[0].value
        if isinstance(test.ops[0], ast.Eq):
            return early == k
        if isinstance(test.ops[0], ast.NotEq):
            return early != k
    return None


def _names(node, params):
    return {params[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in params}


def _waiting_helper(call, scope):
    """The AST of the module-level function call calls, where that function reaches the prologue (so the walk
    must go into it), else None."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        return None
    fn = scope.get(call.func.id)
    if not (inspect.isfunction(fn) and "dependent_launch_prologue" in inspect.getsource(fn)):
        return None
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _reads_before_wait(stmts, params, early, seen, scope=None):
    """Walk stmts in source order (branches on EARLY resolved, other branches and loop bodies taken as written,
    helpers that reach the prologue entered with their parameters bound to the caller's names) until the
    prologue's call; add to seen the kernel parameters (params: local name -> parameter) named before it. True
    once the wait is reached."""
    scope = scope or {}
    for st in stmts:
        if isinstance(st, ast.If):
            v = _test_value(st.test, early)
            if v is not None:
                if _reads_before_wait(st.body if v else st.orelse, params, early, seen, scope):
                    return True
                continue
            seen.update(_names(st.test, params))
            if (_reads_before_wait(st.body, params, early, seen, scope)
                    or _reads_before_wait(st.orelse, params, early, seen, scope)):
                return True
            continue
        if isinstance(st, ast.For):
            seen.update(_names(st.iter, params))
            if _reads_before_wait(st.body, params, early, seen, scope):
                return True
            continue
        call = st.value if isinstance(st, (ast.Expr, ast.Assign)) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dependent_launch_prologue":
            return True
        helper = _waiting_helper(call, scope)
        if helper is not None:
            bound = {}
            for arg, a in zip(helper.args.args, call.args):
                if isinstance(a, ast.Name):
                    bound[arg.arg] = params.get(a.id, "EARLY" if a.id == "EARLY" else None)
                else:
                    seen.update(_names(a, params))  # an expression passed in is evaluated before the call
            bound = {k: v for k, v in bound.items() if v is not None and v != "EARLY"}
            if _reads_before_wait(helper.body, bound, early, seen, scope):
                return True
            continue
        seen.update(_names(st, params))
    return False


@pytest.mark.parametrize("early", [0, 1, 2])
def test_early_loads_read_only_inputs(early):
    """With EARLY = 1 or 2, compute_out_carry names only x, C, B and seq_idx before its wait (the first block's
    inputs), chunk_state (EARLY 1 or 2: its in-loop form) only x and B, the walk no states, C or outputs; each
    still waits before anything else; with 0, nothing before the wait."""
    kernels = {k._pyfunc.__name__: k for k in specs._KERNELS.values()}
    for name, allowed in _EARLY_KERNELS.items():
        k = kernels[name]
        # the array parameters: neither compile-time constants nor run-time scalars (int / float)
        sig = inspect.signature(k._pyfunc).parameters
        arrays = {p for p, node in zip(k._annotated_function.pysig.parameters,
                                        k._annotated_function.parameter_annotations)
                  if not node.constant and sig[p].annotation not in (int, float, "int", "float")}
        seen: set = set()
        assert _reads_before_wait(_body(k), {p: p for p in arrays}, early, seen, k._pyfunc.__globals__), (name, early)
        assert seen <= (allowed if early else set()), (name, early, seen)


def test_early_loads_check_catches_a_scratch_read():
    """The walk above sees a read of a kernel's own scratch (cb, written by chunk_cb just before) ahead of the
    wait, also inside a helper that reaches the wait: mutated bodies fail it."""
    src = textwrap.dedent('''
        def k(x, cb, C, B):
            if EARLY == 1:
                t = load(cb)
                dependent_launch_prologue()
    ''')
    seen: set = set()
    assert _reads_before_wait(ast.parse(src).body[0].body, {"x": "x", "cb": "cb"}, 1, seen)
    assert seen == {"cb"}

    def helper(a, b_):
        t = load(a)  # noqa: F821 - parsed, never run
        dependent_launch_prologue()  # noqa: F821
        return load(b_)  # noqa: F821

    call = ast.parse("helper(cb, x)").body
    seen = set()
    assert _reads_before_wait(call, {"x": "x", "cb": "cb"}, 1, seen, {"helper": helper})
    assert seen == {"cb"}


def test_kernels_without_pdl_never_wait():
    """The backward and decode kernels are launched the ordinary way; none calls the prologue (a wait without
    PDL is harmless, but a kernel that has it belongs in PDL_KERNELS)."""
    for k in specs._KERNELS.values():
        if k._pyfunc.__name__ not in launch.PDL_KERNELS:
            assert "dependent_launch_prologue" not in inspect.getsource(k._pyfunc), k._pyfunc.__name__


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_pdl_environment_variable(value, on):
    assert printed_with_env("from m2ops.kernels import launch; print(launch.PDL)", "M2OPS_PDL", value) == str(on)
