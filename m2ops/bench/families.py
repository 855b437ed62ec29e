"""The model families of python -m m2ops.bench.model --family: which published checkpoint each one's sizes come
from, and a randomly initialised transformers model of the family at those sizes, a few layers deep.

Sizes (the real ones; only the depth is cut, and --vocab may cut the vocabulary). SSM: Mamba-2 heads x head dim,
groups, state, chunk; attention: query/kv heads x head dim; MLP: intermediate size (Granite: a mixture of 64
experts of 512, 6 per token, and a shared one of 1024).

| family | checkpoint | hidden | SSM | attention | MLP | vocab | layers |
|---|---|---|---|---|---|---|---|
| mamba2 | state-spaces/mamba2-2.7b | 2560 | 80x64, 1, 128, 256 | - | - | 50280 | 64 |
| bamba | ibm-ai-platform/Bamba-9B | 4096 | 128x64, 1, 128, 256 | 32/8x128 | 14336 | 128000 | 32 |
| falcon_h1 | tiiuae/Falcon-H1-7B | 3072 | 24x128, 1, 256, 128 | 12/2x128 | 12288 | 130048 | 44 |
| granitemoehybrid | ibm-granite/granite-4.0-h-tiny | 1536 | 48x64, 1, 128, 256 | 12/4x128 | MoE | 100352 | 40 |
| nemotron_h | nvidia/Nemotron-H-8B-Base-8K | 4096 | 128x64, 8, 128, 128 | 32/8x128 | 21504 | 131072 | 52 |
| zamba2 | Zyphra/Zamba2-7B | 3584 | 112x64, 2, 64, 256 | 32/32x224 | 14336 | 32000 | 81 |

Layer patterns: mamba2 all Mamba-2; Bamba attention at 9, 18, 27; Falcon-H1 attention and Mamba-2 side by side in
every layer; Granite attention at 5, 15, 25, 35; Nemotron-H M-M-M-M*-M-M-M-M-M*-... (M Mamba-2, - MLP, * attention);
Zamba2 a shared attention+MLP block before the Mamba-2 of layers 6, 11, 17, 23, ... (every 6th).

Where the numbers come from: the checkpoints' config.json as quoted in public code (Granite tiny, Falcon-H1-7B,
Zamba2-7B: whole; Bamba-9B: hidden, depth, heads, state and attention layers; Nemotron-H-8B: NVIDIA's published
layer pattern and sizes). What those quotes leave out is transformers' config default for the family (Bamba's MLP,
kv heads, Mamba heads and vocabulary: BambaConfig's, written for ibm-fms/Bamba-9.8b-2.2T-hf; Nemotron-H's groups,
chunk and vocabulary: NemotronHConfig's). max_position_embeddings is raised to the longest prompt where the
checkpoint's is shorter (Zamba2: 4096).

Layers: --n-layers consecutive layers of the checkpoint's pattern, ending at its first layer with attention (so a
hybrid keeps its mix of Mamba-2, attention and MLP layers: Nemotron-H's 4 are mamba, mlp, mamba, attention), or its
first n layers where that comes sooner (mamba2: all Mamba-2; falcon_h1: every layer both).
"""

from __future__ import annotations

import dataclasses

import torch

# Layer kinds, as the checkpoints name them: "mamba", "attention", "mlp" (Nemotron-H), "hybrid" (Zamba2: a shared
# attention+MLP block, then Mamba-2; Falcon-H1: attention and Mamba-2 in parallel in every layer).
_GRANITE_TINY = ["mamba"] * 5 + (["attention"] + ["mamba"] * 9) * 3 + ["attention"] + ["mamba"] * 4
_NEMOTRON_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_ZAMBA2_7B = ["mamba"] * 6 + ["hybrid"] + ["mamba"] * 4 + ["hybrid"] + (["mamba"] * 5 + ["hybrid"]) * 11 + ["mamba"] * 3
_BAMBA_9B = ["attention" if i in (9, 18, 27) else "mamba" for i in range(32)]

# Tiny sizes for --smoke (the CPU test suite): the same code paths, chunks of 8 so prompts span several.
_SMOKE_ATTN = dict(num_attention_heads=2, num_key_value_heads=1)
_SMOKE_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    name: str            # the transformers models/ folder, as m2ops.integrations.transformers.patch() names it
    config_class: str    # transformers.<config_class>
    checkpoint: str      # where the sizes come from
    pattern: tuple       # the checkpoint's layer kinds, one per layer
    real: dict           # config arguments at the checkpoint's sizes (no depth)
    smoke: dict          # the same at tiny sizes
    max_positions: int   # the checkpoint's max_position_embeddings
    layers: object = None  # kinds of the chosen layers -> config arguments that lay them out (None: uniform)


# transformers' names for the kinds (it maps the checkpoints' older names to these too)
_TYPE_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "hybrid": "hybrid"}


def _named_types(key):
    return lambda kinds: {key: [_TYPE_NAMES[k] for k in kinds]}


FAMILIES = {f.name: f for f in (
    FamilySpec("mamba2", "Mamba2Config", "state-spaces/mamba2-2.7b", ("mamba",) * 64,
               real=dict(hidden_size=2560, num_heads=80, head_dim=64, n_groups=1, state_size=128, expand=2,
                         conv_kernel=4, chunk_size=256, vocab_size=50280),
               smoke=dict(hidden_size=32, num_heads=4, head_dim=16, n_groups=2, state_size=8, expand=2,
                          chunk_size=8),
               max_positions=0),
    FamilySpec("bamba", "BambaConfig", "ibm-ai-platform/Bamba-9B", tuple(_BAMBA_9B),
               real=dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                         mamba_chunk_size=256, vocab_size=128000),
               smoke=dict(hidden_size=32, intermediate_size=32, **_SMOKE_ATTN, **_SMOKE_MAMBA),
               max_positions=262144,
               layers=lambda kinds: {"attn_layer_indices": [i for i, k in enumerate(kinds) if k == "attention"]}),
    FamilySpec("falcon_h1", "FalconH1Config", "tiiuae/Falcon-H1-7B", ("hybrid",) * 44,
               real=dict(hidden_size=3072, intermediate_size=12288, num_attention_heads=12, num_key_value_heads=2,
                         head_dim=128, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1,
                         mamba_d_state=256, mamba_chunk_size=128, vocab_size=130048),
               smoke=dict(hidden_size=32, intermediate_size=32, mamba_d_ssm=64, **_SMOKE_ATTN, **_SMOKE_MAMBA),
               max_positions=262144),
    FamilySpec("granitemoehybrid", "GraniteMoeHybridConfig", "ibm-granite/granite-4.0-h-tiny", tuple(_GRANITE_TINY),
               real=dict(hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024,
                         num_local_experts=64, num_experts_per_tok=6, num_attention_heads=12, num_key_value_heads=4,
                         mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                         mamba_chunk_size=256, position_embedding_type="nope", vocab_size=100352),
               smoke=dict(hidden_size=32, intermediate_size=16, shared_intermediate_size=16, num_local_experts=2,
                          num_experts_per_tok=1, **_SMOKE_ATTN, **_SMOKE_MAMBA),
               max_positions=131072, layers=_named_types("layer_types")),
    FamilySpec("nemotron_h", "NemotronHConfig", "nvidia/Nemotron-H-8B-Base-8K",
               tuple({"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in _NEMOTRON_8B),
               real=dict(hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                         chunk_size=128, vocab_size=131072),
               smoke=dict(hidden_size=32, intermediate_size=32, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                          n_groups=2, ssm_state_size=8, chunk_size=8, **_SMOKE_ATTN),
               max_positions=8192, layers=_named_types("layers_block_type")),
    FamilySpec("zamba2", "Zamba2Config", "Zyphra/Zamba2-7B", tuple(_ZAMBA2_7B),
               real=dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=32,
                         n_mamba_heads=112, mamba_ngroups=2, mamba_d_state=64, chunk_size=256, num_mem_blocks=2,
                         adapter_rank=128, use_mem_rope=True, vocab_size=32000),
               smoke=dict(hidden_size=32, intermediate_size=32, n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=8,
                          chunk_size=8, num_mem_blocks=2, adapter_rank=4, **_SMOKE_ATTN),
               max_positions=4096, layers=_named_types("layers_block_type")),
)}
SMOKE_VOCAB = 256


def names() -> list[str]:
    return list(FAMILIES)


def layer_window(pattern, n: int) -> tuple[int, tuple]:
    """(first index, kinds) of n consecutive layers of pattern ending at its first layer with attention, or its first
    n where that layer comes before the n-th or the pattern has none."""
    if not 1 <= n <= len(pattern):
        raise ValueError(f"--n-layers {n}: the checkpoint has {len(pattern)} layers")
    first = next((i for i, k in enumerate(pattern) if k in ("attention", "hybrid")), None)
    start = 0 if first is None or first < n - 1 else first - n + 1
    return start, tuple(pattern[start:start + n])


def config_kwargs(spec: FamilySpec, n_layers: int, smoke: bool, vocab: int | None, max_tokens: int) -> dict:
    """The transformers config arguments of spec's model: its sizes (tiny with smoke), n_layers of its pattern, the
    vocabulary (vocab, or the checkpoint's), no EOS (generate() always makes the tokens asked for)."""
    _, kinds = layer_window(spec.pattern, n_layers)
    kwargs = dict(spec.smoke if smoke else spec.real)
    kwargs.update(num_hidden_layers=n_layers, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                  tie_word_embeddings=False)
    if vocab is not None or smoke:
        kwargs["vocab_size"] = vocab if vocab is not None else SMOKE_VOCAB
    if spec.max_positions:
        kwargs["max_position_embeddings"] = max(spec.max_positions, max_tokens)
    if spec.layers is not None:
        kwargs.update(spec.layers(kinds))
    return kwargs


def build(spec: FamilySpec, n_layers: int, smoke: bool, vocab: int | None, max_tokens: int, device, dtype, seed=0):
    """A randomly initialised <family>ForCausalLM (eval mode) on device in dtype, and its config."""
    import transformers
    config = getattr(transformers, spec.config_class)(**config_kwargs(spec, n_layers, smoke, vocab, max_tokens))
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a 4096-wide model initialises slowly on the CPU
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval(), config


def describe(spec: FamilySpec, config, n_layers: int) -> dict:
    """What the JSON and the table title say about the model: checkpoint, chosen layers, key sizes."""
    start, kinds = layer_window(spec.pattern, n_layers)
    keys = ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size", "chunk_size", "mamba_n_heads",
            "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_chunk_size", "mamba_num_heads",
            "mamba_head_dim", "ssm_state_size", "n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_ssm",
            "num_attention_heads", "num_key_value_heads", "intermediate_size", "num_local_experts",
            "num_experts_per_tok", "vocab_size")
    sizes = {k: getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)}
    return {"checkpoint": spec.checkpoint, "checkpoint_layers": len(spec.pattern),
            "layers": f"{start}-{start + n_layers - 1}", "layer_kinds": list(kinds), "sizes": sizes}
