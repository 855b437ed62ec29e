"""Programmatic dependent launch (config.current().pdl): which kernels take it, that each of them waits for the kernel
before it ahead of any memory access, and the environment variable that turns it off."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

from conftest import printed_with_env  # noqa: E402
from m2ops.kernels import registry  # noqa: E402


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
    wait (common.dependent_launch_prologue), before any load or store."""
    kernels = {k._pyfunc.__name__: k for k in registry.KERNELS.values()}
    assert registry.PDL_FUNCTIONS <= set(kernels)
    for name in sorted(registry.PDL_FUNCTIONS):
        assert _first_call(kernels[name]) == "dependent_launch_prologue", name


def test_kernels_without_pdl_never_wait():
    """The backward and decode kernels are launched the ordinary way; none calls the prologue (a wait without
    PDL is harmless, but a kernel that has it is marked PDL in registry.py)."""
    for k in registry.KERNELS.values():
        if k._pyfunc.__name__ not in registry.PDL_FUNCTIONS:
            assert "dependent_launch_prologue" not in inspect.getsource(k._pyfunc), k._pyfunc.__name__


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_pdl_environment_variable(value, on):
    assert printed_with_env("from m2ops.kernels import config; print(config.current().pdl)", "M2OPS_PDL",
                            value) == str(on)
