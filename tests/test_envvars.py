"""The environment variables of README's table: one parser (m2ops/envvars.py), the same spellings for every
switch, and an error naming the variable for any other value, whether it is read at import or at each call."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from m2ops import envvars
from m2ops.kernels import autotune
from m2ops.meta import validate
from m2ops.ops import dispatch


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("On", True), (" YES ", True),
                                        ("0", False), ("false", False), ("OFF", False), ("no", False)])
def test_switch_spellings(monkeypatch, value, want):
    monkeypatch.setenv("M2OPS_SOME_SWITCH", value)
    assert envvars.switch("M2OPS_SOME_SWITCH", None) is want


@pytest.mark.parametrize("default", [True, False, None])
def test_switch_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("M2OPS_SOME_SWITCH", raising=False)
    assert envvars.switch("M2OPS_SOME_SWITCH", default) is default
    for empty in ("", "  "):
        monkeypatch.setenv("M2OPS_SOME_SWITCH", empty)
        assert envvars.switch("M2OPS_SOME_SWITCH", default) is default


@pytest.mark.parametrize("bad", ["2", "ture", "of", "y", "1 0"])
def test_switch_rejects_other_values_by_name(monkeypatch, bad):
    monkeypatch.setenv("M2OPS_SOME_SWITCH", bad)
    with pytest.raises(ValueError, match=rf"M2OPS_SOME_SWITCH={re.escape(repr(bad))}: expected 1 or 0"):
        envvars.switch("M2OPS_SOME_SWITCH", True)


@pytest.mark.parametrize("read, default, good, message", [
    (envvars.seconds, 20.0, (("5", 5.0), (" 0.5 ", 0.5), ("0", 0.0)), "expected a number of seconds >= 0"),
    (envvars.mebibytes, 64 << 20, (("1", 1 << 20), (" 0.5 ", 1 << 19), ("0", 0)), "expected a size in MiB >= 0"),
])
def test_numbers(monkeypatch, read, default, good, message):
    """seconds and mebibytes: the default when unset, the value (in bytes for mebibytes), or an error naming the
    variable for a negative, nan or non-numeric value."""
    monkeypatch.delenv("M2OPS_SOME_NUMBER", raising=False)
    assert read("M2OPS_SOME_NUMBER", 20.0 if read is envvars.seconds else 64) == default
    for raw, want in good:
        monkeypatch.setenv("M2OPS_SOME_NUMBER", raw)
        assert read("M2OPS_SOME_NUMBER", 1) == want
    for bad in ("-1", "nan", "ten", "5s"):
        monkeypatch.setenv("M2OPS_SOME_NUMBER", bad)
        with pytest.raises(ValueError, match=f"M2OPS_SOME_NUMBER=.*: {message}"):
            read("M2OPS_SOME_NUMBER", 1)


def test_switches_read_at_each_call(monkeypatch):
    """M2OPS_AUTOTUNE, M2OPS_TUNE_BUDGET_S, M2OPS_CHECK_VALUES and M2OPS_FORCE_REFERENCE take every spelling,
    and a bad value is an error at the call."""
    seq = torch.zeros(1, 4, dtype=torch.int32)
    readers = {
        "M2OPS_AUTOTUNE": autotune.enabled,
        "M2OPS_CHECK_VALUES": lambda: validate.should_check_values(seq),
        "M2OPS_FORCE_REFERENCE": lambda: dispatch._reason_for_reference(0) == f"{dispatch.FORCE_REFERENCE_ENV} is set",
    }
    for name, read in readers.items():
        for value, want in (("off", False), ("no", False), ("on", True), ("1", True)):
            monkeypatch.setenv(name, value)
            dispatch._reason_for_reference.cache_clear()
            assert read() is want, (name, value)
        monkeypatch.setenv(name, "maybe")
        dispatch._reason_for_reference.cache_clear()
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)
    dispatch._reason_for_reference.cache_clear()
    monkeypatch.setenv("M2OPS_TUNE_BUDGET_S", "3")
    assert autotune.budget_s() == 3.0
    monkeypatch.setenv("M2OPS_TUNE_BUDGET_S", "-3")
    with pytest.raises(ValueError, match="M2OPS_TUNE_BUDGET_S"):
        autotune.budget_s()


# The switches read when their module is imported, and the value each sets (an expression after the import).
_AT_IMPORT = {
    "M2OPS_PDL": "m2ops.kernels.config.current().pdl",
    "M2OPS_INDEX32": "m2ops.kernels.config.current().index32",
    "M2OPS_RECOMPUTE_STATES": "m2ops.ops.eager.KEEP_STATES",
    "M2OPS_BWD_SEPARATE_CARRY": "m2ops.kernels.config.current().separate_carry_grad",
}


# What a process prints after importing the modules that read the switches: each value, one line per expression.
_PRINT_VALUES = ("import m2ops.kernels.config, m2ops.ops.eager\n"
                 f"for expr in {list(_AT_IMPORT.values())!r}:\n"
                 "    print(expr, eval(expr))\n")

# One interpreter imports torch (the slow part; no m2ops module), then forks a process per environment, which sets
# it, imports m2ops afresh and runs _PRINT_VALUES: a failure prints its traceback as the interpreter would and exits
# 1. Prints [exit code, stdout, stderr] of each process, as JSON.
_FORK_PER_ENV = """
import json, os, sys, tempfile, traceback
import torch
assert not [m for m in sys.modules if m.split(".")[0] == "m2ops"]
envs, code = json.loads(sys.argv[1]), sys.argv[2]
done = []
for env in envs:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ.update(env)
            status = 0
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        done.append([os.waitstatus_to_exitcode(wait_status), out.read(), err.read()])
print(json.dumps(done))
"""


def _import_and_print(*envs: dict) -> list[subprocess.CompletedProcess]:
    """For each environment of envs (its M2OPS_ variables, the others unset): the process that imported the
    modules with it and printed _AT_IMPORT's values, each process importing m2ops for the first time."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("M2OPS_")}
    run = subprocess.run([sys.executable, "-c", _FORK_PER_ENV, json.dumps(envs), _PRINT_VALUES], env=clean,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return [subprocess.CompletedProcess(["import", env], code, out, err)
            for env, (code, out, err) in zip(envs, json.loads(run.stdout), strict=True)]


def test_switches_read_at_import():
    """Set to "off" (or "on"), each import-time switch gives its value; set to anything else, importing the module
    fails with an error naming the variable. (Each environment in a process of its own, forked from one
    interpreter.)"""
    pytest.importorskip("cuda.tile")
    bad = [{name: "sometimes"} for name in _AT_IMPORT]
    off, on, *failed = _import_and_print({name: "off" for name in _AT_IMPORT},
                                         {"M2OPS_RECOMPUTE_STATES": "on", "M2OPS_BWD_SEPARATE_CARRY": "yes"}, *bad)
    assert off.returncode == 0, off.stderr
    got = dict(line.split(" ", 1) for line in off.stdout.strip().splitlines())
    assert got == {"m2ops.kernels.config.current().pdl": "False", "m2ops.kernels.config.current().index32": "False",
                   "m2ops.ops.eager.KEEP_STATES": "True",
                   "m2ops.kernels.config.current().separate_carry_grad": "False"}
    assert on.returncode == 0, on.stderr
    got = dict(line.split(" ", 1) for line in on.stdout.strip().splitlines())
    assert got["m2ops.ops.eager.KEEP_STATES"] == "False"
    assert got["m2ops.kernels.config.current().separate_carry_grad"] == "True"
    assert got["m2ops.kernels.config.current().pdl"] == "True"  # unset: the default
    for name, done in zip(_AT_IMPORT, failed, strict=True):
        assert done.returncode != 0 and f"ValueError: {name}='sometimes': expected 1 or 0" in done.stderr, name


def test_no_switch_is_read_outside_envvars():
    """Every M2OPS_ variable in the package is read through m2ops/envvars.py, except M2OPS_TUNING_CACHE (a path);
    setting one (the bench's workers) is not reading it."""
    root = pathlib.Path(__file__).resolve().parents[1] / "m2ops"
    direct = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "envvars.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            read = re.search(r"environ\.get\(\s*\"M2OPS_|environ\[\s*\"M2OPS_\w*\"\s*\](?!\s*=[^=])", line)
            if read and "M2OPS_TUNING_CACHE" not in line:
                direct.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not direct, "\n".join(direct)
