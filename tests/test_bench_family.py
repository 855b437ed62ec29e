"""python -m m2ops.bench.model --family on the CPU: --smoke runs every family, tiny, without and with m2ops, and
writes the JSON the GPU run fills; the real sizes make valid configs and models (built on the meta device); a bad
--family is one line naming the known families."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from m2ops.bench import families, model_family  # noqa: E402
from m2ops.bench import model as bench_model  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One in-process run of every family (a subprocess would import torch and transformers again), on one thread:
    the models are tiny, and a second thread only waits whenever another process shares the two cores."""
    out = tmp_path_factory.mktemp("family") / "family.json"
    printed = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(printed):
            bench_model.main(["--family", "all", "--smoke", "--device", "cpu", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text()), printed.getvalue()


def test_every_family_runs_both_implementations(smoke):
    r, printed = smoke
    import m2ops.integrations.transformers as m2tf
    assert not m2tf.is_patched()
    assert {"device_name", "torch", "transformers", "m2ops", "mamba_ssm", "m2ops_backend"} <= set(r["env"])
    assert r["settings"]["seqlens"] == [40, 72] and r["settings"]["batches"] == [1, 3]
    assert list(r["families"]) == families.names()
    for name, fam in r["families"].items():
        assert "error" not in fam, (name, fam.get("error"))
        assert fam["model"]["checkpoint"] == families.FAMILIES[name].checkpoint
        assert len(fam["model"]["layer_kinds"]) == 4 and fam["model"]["params"] > 0
        assert fam["transformers_path"]["summary"]
        assert set(fam["results"]) == {"transformers", "m2ops"}
        for impl, res in fam["results"].items():
            for T in ("40", "72"):
                t = res["prefill"][T]
                assert "error" not in t, (name, impl, T, t)
                assert t["median_ms"] > 0 and len(t["runs_ms"]) == 1 and math.isfinite(t["tokens_per_s"])
            for B in ("1", "3"):
                d = res["decode"][B]
                assert "error" not in d, (name, impl, B, d)
                assert d["median_ms"] > 0 and d["generate_1_median_ms"] > 0 and math.isfinite(d["ms_per_token"])
                # the StaticCache path runs for every family (uncompiled off CUDA)
                assert d["mode"].startswith("StaticCache") and not d.get("graphs_error"), (name, impl, d)
        # float32 on the CPU: the same last-token logits
        checks = fam["checks"]["last_logits"]
        assert set(checks) == {"40", "72"}
        assert all(c["max_rel_err"] < 1e-4 for c in checks.values()), (name, checks)
        assert f"### {name}: " in printed and f"### {name}: " in r["markdown"]
    assert printed.count("| prefill 1 x 72 tokens (ms) |") == len(families.names())


def test_profiles_show_which_implementation_ran(smoke):
    for name, fam in smoke[0]["families"].items():
        m2, tf = fam["results"]["m2ops"]["profiled"], fam["results"]["transformers"]["profiled"]
        assert "m2ops::chunk_cumsum" in m2["prefill"], name
        assert "m2ops::state_update_inplace" in m2["decode"], name
        assert not any(k.startswith("m2ops::") for part in tf.values() for k in part), name


def test_unknown_family_is_one_line_naming_the_known_ones():
    for argv in (["--family", "mamba3"], ["--family", "bamba,nope", "--smoke"], ["--family="]):
        with pytest.raises(SystemExit) as e:
            bench_model.main(argv)
        msg = str(e.value.code)
        assert "\n" not in msg and "--family" in msg
        assert all(name in msg for name in ["all", *families.names()])


def test_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as e:
        model_family.parse_args(["--family", "all", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--n-layers", "--seqlen", "--batch", "--decode", "--new-tokens", "--vocab", "--smoke", "--out"):
        assert opt in text
    for bad in (["--seqlen", "4k"], ["--batch", "0"], ["--modes", "train"], ["--new-tokens", "1"]):
        with pytest.raises(SystemExit):
            model_family.parse_args(["--family", "zamba2", "--device", "cpu", *bad])


def test_defaults_are_the_gpu_run():
    a = model_family.parse_args(["--family", "all", "--device", "cpu"])
    assert a.families == families.names() and a.n_layers == 4
    assert (a.seqlens, a.batches, a.runs, a.decode) == ([4096, 32768], [1, 32], 3, "graphs")


def test_layers_end_at_the_first_attention():
    window = {name: families.layer_window(spec.pattern, 4) for name, spec in families.FAMILIES.items()}
    assert window["mamba2"] == (0, ("mamba",) * 4)
    assert window["falcon_h1"] == (0, ("hybrid",) * 4)
    assert window["bamba"] == (6, ("mamba", "mamba", "mamba", "attention"))
    assert window["granitemoehybrid"] == (2, ("mamba", "mamba", "mamba", "attention"))
    assert window["nemotron_h"] == (4, ("mamba", "mlp", "mamba", "attention"))
    assert window["zamba2"] == (3, ("mamba", "mamba", "mamba", "hybrid"))
    assert [len(s.pattern) for s in families.FAMILIES.values()] == [64, 32, 44, 40, 52, 81]
    with pytest.raises(ValueError, match="--n-layers 90"):
        families.layer_window(families.FAMILIES["bamba"].pattern, 90)


@pytest.mark.parametrize("name", families.names())
def test_real_sizes_make_the_model(name):
    """The checkpoint's sizes give a valid config and model (on the meta device: nothing allocated), with the
    Mamba-2 widths of the table."""
    import transformers
    spec = families.FAMILIES[name]
    kwargs = families.config_kwargs(spec, 4, smoke=False, vocab=None, max_tokens=32768 + 64)
    config = getattr(transformers, spec.config_class)(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    mixers = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias")]
    assert mixers, name
    heads = {"mamba2": 80, "bamba": 128, "falcon_h1": 24, "granitemoehybrid": 48, "nemotron_h": 128,
             "zamba2": 112}[name]
    assert all(m.A_log.shape == (heads,) for m in mixers)
    d = families.describe(spec, config, 4)
    assert d["sizes"]["vocab_size"] == config.vocab_size > 30000 and d["checkpoint"] == spec.checkpoint
    assert getattr(config, "max_position_embeddings", 32768 + 64) >= 32768 + 64
