"""m2ops.integrations.transformers.patch() on every transformers family with Mamba-2 mixers: for a tiny random
model of each (hybrid attention layers kept tiny), in float32 and bfloat16, logits equal to transformers' own
path, greedy generate() equal with the cache (so the one-token decode and convolution run through m2ops), m2ops
ops in the profiler after patch() and none after unpatch(); packed sequences and training per family; the
checks that name a family whose functions no longer match."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import m2ops.integrations.transformers as m2tf  # noqa: E402
from m2ops.integrations import transformers_families  # noqa: E402
from transformers_tiny import (CONFIGS, DECODE_OPS, DTYPES, LOGIT_ATOL, NORM_OP, SCAN_OPS,  # noqa: E402
                               assert_same_generation, build, generate, has_norm, ids, m2ops_events)


@pytest.fixture(autouse=True)
def always_unpatch():
    m2tf.unpatch()
    yield
    m2tf.unpatch()


@functools.lru_cache(maxsize=None)
def model(key, dtype=torch.float32):
    return build(key, dtype)


def test_every_family_found_has_a_config():
    found = {f.name for f in m2tf.families()}
    assert {family for family, _, _ in CONFIGS.values()} <= found
    assert found <= {family for family, _, _ in CONFIGS.values()}, "a new family: add a tiny config"
    for family in m2tf.families():
        assert family.problems == [] and family.norm_problems == [], family
        assert len(family.norm_classes) == 1


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("key", CONFIGS)
def test_logits_generate_and_ops(key, dtype):
    m, x = model(key, dtype), ids()
    with torch.no_grad():
        want, want_gen = m(x).logits, generate(m, x)
        m2tf.patch()
        got, prefill_events = m2ops_events(lambda: m(x).logits)
        got_gen, gen_events = m2ops_events(lambda: generate(m, x))
        m2tf.unpatch()
        _, after = m2ops_events(lambda: (m(x), generate(m, x)))
    atol = LOGIT_ATOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    assert_same_generation(got_gen, want_gen, x.shape[1], atol, exact=dtype == torch.float32)
    norm = {NORM_OP} if has_norm(key) else set()
    assert SCAN_OPS | norm <= prefill_events, prefill_events
    assert SCAN_OPS | DECODE_OPS | norm <= gen_events, gen_events
    assert after == set()


@pytest.mark.parametrize("key", CONFIGS)
def test_left_padded_batch_generates_the_same(key):
    """A batch of prompts of different lengths (left padding, attention_mask): the padded positions are masked
    the same way around the m2ops ops."""
    m, x = model(key), ids(batch=3, seqlen=10, seed=4)
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    mask[2, :2] = 0
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = generate(m, x, attention_mask=mask)
        m2tf.patch()
        got = generate(m, x, attention_mask=mask)
    assert_same_generation(got, want, x.shape[1], LOGIT_ATOL[torch.float32], exact=True)


# How each family's forward takes packed sequences: Mamba2ForCausalLM does not hand extra keyword arguments to
# its backbone; GraniteMoeHybrid's attention does not read packing from position_ids, a mask dict gives it.
def packed_forward(key, m, x, lens, packing):
    if key == "mamba2":
        return m.lm_head(m.backbone(x, use_cache=False, **packing).last_hidden_state)
    if key == "granitemoehybrid":
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        causal = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
        mask = {"full_attention": ((seq[:, None] == seq[None, :]) & causal)[None, None], "linear_attention": None}
        return m(x, use_cache=False, attention_mask=mask, **packing).logits
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    return m(x, use_cache=False, position_ids=position_ids, **packing).logits


@pytest.mark.parametrize("key", CONFIGS)
def test_packed_sequences(key):
    """seq_idx or cu_seqlens passed to the model's forward keep packed sequences apart: equal to running each
    sequence alone."""
    m, lens = model(key), [5, 9, 4]
    x = ids(batch=1, seqlen=sum(lens), seed=3)
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lens))[None]
    m2tf.patch()
    with torch.no_grad():
        alone = torch.cat([m(x[:, s:e], use_cache=False).logits for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())],
                          dim=1)
        by_idx = packed_forward(key, m, x, lens, {"seq_idx": seq_idx})
        by_cu = packed_forward(key, m, x, lens, {"cu_seqlens": cu})
    torch.testing.assert_close(by_idx, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_cu, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", [k for k in CONFIGS if k != "mamba2"])  # (tests/test_transformers.py has it)
def test_training_loss_and_gradients(key):
    """model.train(): the fused call answers "no fused kernel", the unfused path runs on m2ops's differentiable
    ops; loss and gradients equal transformers' own."""
    m, x = model(key), ids(seqlen=11, seed=2)
    mixer = next(mod for mod in m.modules() if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"))
    m.train()
    try:
        results = []
        for patched in (False, True):
            if patched:
                m2tf.patch()
            loss, events = m2ops_events(lambda: m(x, labels=x).loss)
            loss.backward()
            results.append((loss.detach(), mixer.A_log.grad.clone(), mixer.in_proj.weight.grad.clone(), events))
            m.zero_grad()
    finally:
        m.eval()
    (want, want_a, want_w, _), (got, got_a, got_w, events) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_a, want_a, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got_w, want_w, rtol=1e-3, atol=1e-5)
    assert SCAN_OPS <= events


def test_patch_unpatch_every_family():
    families = m2tf.families()
    before = {f.name: {n: getattr(f.module, n) for n in transformers_families.FUNCTIONS} for f in families}
    norms = {f.name: {c: getattr(f.module, c).forward for c in f.norm_classes} for f in families}
    assert sorted(m2tf.patch()) == sorted(before)
    for f in families:
        assert m2tf.is_patched(f.name)
        assert all(getattr(f.module, n) is fn for n, fn in transformers_families.FUNCTIONS.items())
        assert all(getattr(f.module, c).forward is fwd for c, fwd in f.norm_classes.items())
    m2tf.patch()  # idempotent: the replacements are not saved as originals
    m2tf.unpatch(["bamba"])
    assert not m2tf.is_patched("bamba") and m2tf.is_patched("zamba2")
    m2tf.unpatch()
    assert not m2tf.is_patched()
    for f in families:
        assert all(getattr(f.module, n) is fn for n, fn in before[f.name].items())
        assert all(getattr(f.module, c).forward is fwd for c, fwd in norms[f.name].items())
    with m2tf.patched(["nemotron_h"]):
        assert m2tf.is_patched("nemotron_h") and not m2tf.is_patched("mamba2")
    assert not m2tf.is_patched()


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="families must name.*'mamba1'"):
        m2tf.patch(["mamba1"])
    assert not m2tf.is_patched()


@pytest.fixture
def rediscover():
    transformers_families.discover.cache_clear()
    yield
    transformers_families.discover.cache_clear()


def test_changed_function_names_its_family(monkeypatch, rediscover):
    """A family whose helper no longer has the parameters m2ops replaces is refused by name, before anything is
    patched; the others can still be patched."""
    module = transformers_families.select(["zamba2"])[0].module
    transformers_families.discover.cache_clear()

    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, new_option=False, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(module, "mamba2_chunk_scan", mamba2_chunk_scan)
    monkeypatch.delattr(module, "causal_conv1d_update")
    with pytest.raises(RuntimeError, match=r"the zamba2 family \(transformers\.models\.zamba2\.modeling_zamba2"
                                           r".*mamba2_chunk_scan takes \(.*new_option=False.*it has no "
                                           r"causal_conv1d_update.*patch\(families=\["):
        m2tf.patch()
    assert not m2tf.is_patched()
    others = [f.name for f in m2tf.families() if f.name != "zamba2"]
    assert m2tf.patch(others) == others
    assert module.mamba2_chunk_scan is mamba2_chunk_scan


def test_changed_norm_keeps_its_forward(monkeypatch, rediscover):
    """A gated norm that no longer computes what m2ops.rms_norm_gated does keeps its own forward (with a
    warning); the helpers are still patched."""
    module = transformers_families.select(["bamba"])[0].module
    transformers_families.discover.cache_clear()
    original = module.BambaRMSNormGated.forward
    monkeypatch.setattr(module.BambaRMSNormGated, "forward",
                        lambda self, hidden_states, gate=None: original(self, hidden_states, None))
    changed = module.BambaRMSNormGated.forward
    with pytest.warns(UserWarning, match="bamba family's gated norm stays.*BambaRMSNormGated"):
        m2tf.patch(["bamba"])
    assert module.BambaRMSNormGated.forward is changed
    assert module.mamba2_chunk_scan is m2tf.chunk_scan
