"""Tiny random transformers models of every family with Mamba-2 mixers, and comparisons, for the
tests/test_transformers_*.py files."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import transformers

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
ATTN = dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
# Mamba-2 sizes shared by the hybrids: 4 heads of 16 (expand 2 of hidden 32), 2 groups, state 8, chunks of 8.
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)

# config key -> (family, config class name, arguments). Every family found must have one
# (test_transformers_families.py checks).
CONFIGS = {
    "mamba2": ("mamba2", "Mamba2Config", dict(num_heads=8, head_dim=8, state_size=16, n_groups=2, expand=2,
                                              conv_kernel=4, num_hidden_layers=2, chunk_size=8)),
    "bamba": ("bamba", "BambaConfig", dict(intermediate_size=32, num_hidden_layers=2, attn_layer_indices=[1],
                                           **ATTN, **MAMBA)),
    # Falcon-H1 without the gated norm (the gate goes into the decode step) and with it (norm before the gate).
    "falcon_h1": ("falcon_h1", "FalconH1Config", dict(intermediate_size=32, num_hidden_layers=2, mamba_d_ssm=64,
                                                      **ATTN, **MAMBA)),
    "falcon_h1-norm": ("falcon_h1", "FalconH1Config", dict(intermediate_size=32, num_hidden_layers=2,
                                                           mamba_d_ssm=64, mamba_rms_norm=True,
                                                           mamba_norm_before_gate=True, **ATTN, **MAMBA)),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridConfig", dict(
        intermediate_size=16, num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=16, **ATTN, **MAMBA)),
    "nemotron_h": ("nemotron_h", "NemotronHConfig", dict(
        layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3, head_dim=16, intermediate_size=32,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8, **ATTN)),
    "zamba2": ("zamba2", "Zamba2Config", dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                                              n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, chunk_size=8,
                                              intermediate_size=32, adapter_rank=4, **ATTN)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Logits: float32 agrees to rounding; bfloat16 rounds m2ops's outputs to bfloat16 where transformers' scan keeps
# float32. Greedy tokens: equal in float32; in bfloat16 equal up to a near tie of the reference's logits.
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}

SCAN_OPS = {"m2ops::chunk_cumsum", "m2ops::chunk_scan", "m2ops::causal_conv1d"}
DECODE_OPS = {"m2ops::state_update_inplace", "m2ops::causal_conv1d_update"}
NORM_OP = "m2ops::rms_norm_gated"


def build(key, dtype=torch.float32):
    """A fresh tiny model for CONFIGS[key], in eval mode."""
    _, config_class, kwargs = CONFIGS[key]
    config = getattr(transformers, config_class)(**COMMON, **kwargs)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random A, D, dt_bias and norm weights instead of the structured init
        for mod in m.modules():
            if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
                mod.A_log.uniform_(-1.0, 1.0)
                mod.D.normal_()
                mod.dt_bias.normal_(0.0, 0.5)
                if hasattr(mod.norm, "weight"):
                    mod.norm.weight.normal_(1.0, 0.3)
    return m.to(dtype)


def has_norm(key):
    """Falcon-H1 has the gated norm only with mamba_rms_norm (default False); the other families always."""
    family, _, kwargs = CONFIGS[key]
    return family != "falcon_h1" or kwargs.get("mamba_rms_norm", False)


def ids(batch=2, seqlen=13, seed=0):
    return torch.randint(3, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def m2ops_events(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("m2ops::")}


def generate(m, x, **kwargs):
    """Greedy, 6 new tokens, with the cache (so 5 one-token decode steps), keeping each step's logits."""
    return m.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, **kwargs)


def assert_same_generation(got, want, prompt_len, atol, exact):
    """Per row and step: logits close; tokens equal (exact) or, at the first difference, a near tie of the
    reference's logits (after it the two continuations see different inputs)."""
    for row in range(want.sequences.shape[0]):
        for step, (g, w) in enumerate(zip(got.logits, want.logits)):
            g, w = g[row].float(), w[row].float()
            torch.testing.assert_close(g, w, atol=atol, rtol=0)
            tg, tw = got.sequences[row, prompt_len + step], want.sequences[row, prompt_len + step]
            if tg != tw:
                assert not exact, f"row {row} step {step}: token {int(tg)} instead of {int(tw)}"
                assert abs(w[tg] - w[tw]) <= 2 * atol, f"row {row} step {step}: not a near tie"
                break
