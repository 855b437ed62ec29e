"""m2ops through transformers' kernel mapping (m2ops.integrations.transformers.kernel_mapping / kernelize).

The mapping's shape and its layers' signatures are checked against the installed transformers always; the
kernelize tests need the `kernels` package in the versions transformers enables (skipped otherwise): per family a
kernelized tiny model gives transformers' logits and greedy tokens with m2ops ops in the profiler, while another
instance of the same model stays on transformers' path."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import m2ops.integrations.transformers as m2tf  # noqa: E402
from m2ops.integrations import transformers_adapters, transformers_kernels  # noqa: E402
from transformers.utils.import_utils import is_kernels_available  # noqa: E402
from transformers_tiny import (CONFIGS, DECODE_OPS, SCAN_OPS, assert_same_generation, build, generate,  # noqa: E402
                               ids, m2ops_events)

try:
    import kernels
except ImportError:
    kernels = None
needs_kernels = pytest.mark.skipif(kernels is None or not is_kernels_available(),
                                   reason="needs the `kernels` package in the versions transformers enables")


def decorated_layer_names(module):
    """function name -> the layer name transformers decorates it with, read from the module's source (the
    decorator records nothing when `kernels` is missing)."""
    source = inspect.getsource(module)
    pairs = re.findall(r'@use_kernel_func_from_hub_with_fallback\("(\w+)"[^)]*\)\s*\ndef (\w+)\(', source)
    return {func: layer for layer, func in pairs}


def test_mapping_covers_every_helper_of_every_family():
    mapping = m2tf.kernel_mapping()
    for family in m2tf.families():
        layers = decorated_layer_names(family.module)
        assert set(layers) == set(transformers_adapters.FUNCTIONS), family.name
        for func, layer in layers.items():
            assert set(mapping[layer]) == {"cuda", "cpu"}
            cls = mapping[layer]["cuda"].load()
            # kernels requires the layer's forward to take the helper's parameters (self first)
            params = [(p.name, p.kind, p.default) for p in inspect.signature(cls.forward).parameters.values()][1:]
            adapter = transformers_adapters.FUNCTIONS[func]
            assert params == [(p.name, p.kind, p.default) for p in inspect.signature(adapter).parameters.values()]
            # stateless, nothing but forward and the two flags kernels reads
            assert set(vars(cls)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__",
                                     "__static_attributes__"} == {"forward", "can_torch_compile", "has_backward"}


def test_repository_and_arguments():
    repo = m2tf.M2opsRepository("causal_conv1d_fn")
    assert repo == m2tf.M2opsRepository("causal_conv1d_fn") and hash(repo) == hash(m2tf.M2opsRepository(
        "causal_conv1d_fn"))
    assert repo != m2tf.M2opsRepository("causal_conv1d_update")
    assert repo.load() is transformers_kernels.Conv1dFn and "m2ops" in str(repo)
    assert set(m2tf.kernel_mapping("cuda")["selective_state_update"]) == {"cuda"}
    with pytest.raises(ValueError, match="layer_name must be one of"):
        m2tf.M2opsRepository("rms_norm")
    with pytest.raises(ValueError, match="devices must be 'cuda' and/or 'cpu'.*'xpu'"):
        m2tf.kernel_mapping(("cuda", "xpu"))


@pytest.mark.skipif(kernels is not None, reason="`kernels` is installed")
def test_kernelize_without_kernels_says_so():
    with pytest.raises(ImportError, match="needs the `kernels` package"):
        m2tf.kernelize(build("mamba2"))


@needs_kernels
@pytest.mark.parametrize("key", CONFIGS)
def test_kernelize_each_family(key):
    reference, m, x = build(key), build(key), ids()
    assert m2tf.kernelize(m) is m
    assert len(m2tf.routed(m)) >= 5 and m2tf.routed(reference) == []
    with torch.no_grad():
        want, want_gen = reference(x).logits, generate(reference, x)
        got, prefill_events = m2ops_events(lambda: m(x).logits)
        got_gen, gen_events = m2ops_events(lambda: generate(m, x))
        _, reference_events = m2ops_events(lambda: generate(reference, x))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert_same_generation(got_gen, want_gen, x.shape[1], 1e-4, exact=True)
    assert SCAN_OPS <= prefill_events and SCAN_OPS | DECODE_OPS <= gen_events, gen_events
    assert reference_events == set()  # per instance: the other model is untouched


@needs_kernels
def test_transformers_kernelize_in_the_mapping_context():
    """The route as transformers documents it: its kernelize() under kernels.use_kernel_mapping."""
    reference, m, x = build("bamba"), build("bamba"), ids()
    with kernels.use_kernel_mapping(m2tf.kernel_mapping()):
        transformers.kernelize(m)
    with torch.no_grad():
        got, events = m2ops_events(lambda: m(x).logits)
        want = reference(x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert SCAN_OPS <= events


@needs_kernels
def test_mamba1_decode_stays_its_own():
    """The layer names are shared with Mamba-1: its convolution runs on m2ops, its (batch, dim, dstate) decode
    step on transformers' own implementation."""
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    reference = transformers.MambaForCausalLM(config).eval()
    m = transformers.MambaForCausalLM(config).eval()
    m.load_state_dict(reference.state_dict())
    m2tf.kernelize(m)
    x = ids()
    with torch.no_grad():
        want = generate(reference, x)
        got, events = m2ops_events(lambda: generate(m, x))
    assert_same_generation(got, want, x.shape[1], 1e-4, exact=True)
    assert {"m2ops::causal_conv1d", "m2ops::causal_conv1d_update"} <= events
    assert "m2ops::state_update_inplace" not in events
