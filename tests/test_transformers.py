"""m2ops.integrations.transformers: a tiny random Mamba2ForCausalLM gives the same logits and greedy tokens
before and after patch(), m2ops ops run after it (torch.profiler), packed sequences work, unpatch() restores.
(tests/test_transformers_families.py does the same for every family.)"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

transformers = pytest.importorskip("transformers")
mm = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

import m2ops.integrations.transformers as m2tf  # noqa: E402

# Without return_varlen_states the public function runs chunk_cumsum then chunk_scan.
SCAN_OPS = ("m2ops::chunk_cumsum", "m2ops::chunk_scan")
NAMES = ("mamba2_chunk_scan", "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update",
         "mamba2_split_conv1d_scan_combined")


@pytest.fixture(autouse=True)
def always_unpatch():
    m2tf.unpatch()
    yield
    m2tf.unpatch()


@pytest.fixture(scope="module")
def model():
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_heads=8, head_dim=8, state_size=16,
                                       n_groups=2, expand=2, conv_kernel=4, num_hidden_layers=2, chunk_size=8,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # random A and D instead of the structured init, so that every head differs
        for layer in m.backbone.layers:
            layer.mixer.A_log.uniform_(-1.0, 1.0)
            layer.mixer.D.normal_()
            layer.mixer.norm.weight.normal_(1.0, 0.3)
    return m


def ids(batch=2, seqlen=21, seed=0):
    return torch.randint(3, 64, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def m2ops_events(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("m2ops::")}


def test_same_logits(model):
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        m2tf.patch()
        got, events = m2ops_events(lambda: model(x).logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert set(SCAN_OPS) <= events, events


def test_same_greedy_tokens_and_decode_op(model):
    x = ids(seqlen=11, seed=1)
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        want = model.generate(x, **kw)
        m2tf.patch()
        got, events = m2ops_events(lambda: model.generate(x, **kw))
    assert torch.equal(got, want), (got, want)
    decode = {"m2ops::state_update_inplace", "m2ops::causal_conv1d_update", "m2ops::rms_norm_gated"}
    assert decode <= events and set(SCAN_OPS) <= events, events


def test_training_forward_backward(model):
    """model.train() takes transformers' fused-kernel branch first; patched, it falls through to m2ops."""
    x = ids(seqlen=17, seed=2)
    model.train()
    try:
        want = model(x, labels=x).loss
        want.backward()
        want_grad = model.backbone.layers[0].mixer.A_log.grad.clone()
        model.zero_grad()
        m2tf.patch()
        got, events = m2ops_events(lambda: model(x, labels=x).loss)
        got.backward()
        got_grad = model.backbone.layers[0].mixer.A_log.grad.clone()
        model.zero_grad()
    finally:
        model.eval()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-3, atol=1e-5)
    assert set(SCAN_OPS) <= events


def test_packed_sequences(model):
    """seq_idx / cu_seqlens through Mamba2Model.forward: refused by transformers without mamba_ssm, equal to
    running each sequence alone with m2ops."""
    x = ids(batch=1, seqlen=20, seed=3)
    cu = torch.tensor([0, 6, 15, 20], dtype=torch.int32)
    seq_idx = torch.tensor([[0] * 6 + [1] * 9 + [2] * 5], dtype=torch.int32)
    backbone = model.backbone
    with torch.no_grad():
        if mm.mamba2_chunk_scan.__module__ == mm.__name__:  # transformers' torch fallback is active
            with pytest.raises(ValueError, match="packed sequences"):
                backbone(x, seq_idx=seq_idx, use_cache=False)
        m2tf.patch()
        alone = torch.cat([backbone(x[:, s:e], use_cache=False).last_hidden_state
                           for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        by_idx = backbone(x, seq_idx=seq_idx, use_cache=False).last_hidden_state
        by_cu = backbone(x, cu_seqlens=cu, use_cache=False).last_hidden_state
    torch.testing.assert_close(by_idx, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_cu, alone, rtol=1e-5, atol=1e-5)


def test_unpatch_restores():
    before = {n: getattr(mm, n) for n in NAMES}
    norm_forward = mm.MambaRMSNormGated.forward
    m2tf.patch()
    assert m2tf.is_patched()
    assert all(getattr(mm, n) is not before[n] for n in NAMES)
    m2tf.patch()  # idempotent: a second patch does not save the replacements as originals
    m2tf.unpatch()
    assert not m2tf.is_patched()
    assert all(getattr(mm, n) is before[n] for n in NAMES)
    with m2tf.patched():
        assert mm.mamba2_chunk_scan is m2tf.chunk_scan
        assert mm.MambaRMSNormGated.forward is not norm_forward
    assert mm.mamba2_chunk_scan is before["mamba2_chunk_scan"]
    assert mm.MambaRMSNormGated.forward is norm_forward
