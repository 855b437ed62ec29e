"""The main job's command line (python -m m2ops): every option checked before any work, a bad one answered with
one line that names it and code 2, defaults in --help, and a small run end to end."""

import subprocess
import sys

import pytest
import torch

from m2ops.__main__ import main, parse_args


@pytest.mark.parametrize("argv, option", [
    (["--chunk-size", "0"], "--chunk-size"),
    (["--batch", "-1"], "--batch"),
    (["--seqlen", "0"], "--seqlen"),
    (["--nheads", "x"], "--nheads"),
    (["--headdim", "1.5"], "--headdim"),
    (["--dstate", "0"], "--dstate"),
    (["--repeats", "-1"], "--repeats"),
    (["--seed", "-3"], "--seed"),
    (["--sequences", "0"], "--sequences"),
    (["--sequences", "5000", "--seqlen", "10"], "--sequences"),
    (["--ngroups", "3"], "--ngroups"),  # does not divide the default 8 heads
    (["--dtype", "half"], "--dtype"),
    (["--device", "foo"], "--device"),
    (["--device", "cuda:x"], "--device"),
])
def test_a_bad_option_is_one_line_naming_it(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and f"argument {option}:" in err, err
    assert "expected" in err or "invalid choice" in err, err


def test_cuda_without_a_cuda_device_is_refused_up_front(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "--device" in err and "no CUDA device" in err and err.count("\n") == 1


def test_limits_themselves_are_accepted():
    a = parse_args(["--sequences", "10", "--seqlen", "10", "--repeats", "0", "--ngroups", "8", "--device", "cpu"])
    assert (a.sequences, a.seqlen, a.repeats, a.ngroups, a.device) == (10, 10, 0, 8, "cpu")


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for default in ("(default: 2)", "(default: 1000)", "(default: 128)", "(default: auto)", "(default: 5)"):
        assert default in " ".join(out.split()), default


def test_the_command_line_fails_before_compiling():
    """The reported case: a chunk size of 0 used to surface from inside torch.compile's trace."""
    r = subprocess.run([sys.executable, "-m", "m2ops", "--chunk-size", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "python -m m2ops: error: argument --chunk-size: expected a positive integer; got '0' "
        "(see python -m m2ops --help)"]


def test_a_small_run_checks_out(capsys):
    code = main(["--seqlen", "40", "--nheads", "2", "--headdim", "4", "--dstate", "8", "--chunk-size", "16",
                 "--sequences", "3", "--repeats", "1", "--no-compile", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "sequences=3" in out and out.rstrip().endswith("OK")
