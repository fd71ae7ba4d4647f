"""Cache-relevant architecture fields of the real default models (their config.json values)."""

SMOLLM2_135M = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}

GEMMA3_270M = {
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}

# Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults): gated DeltaNet layers, every
# 4th full attention; a linear layer's state is a conv over q, k, v plus [32, 128, 128].
QWEN3_NEXT_80B = {
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}

# Gemma 4 E4B (NVIDIA Megatron Bridge's recipe for google/gemma-4-E4B-it): 5 sliding : 1 full, sliding
# layers' head dim 256, full layers' 512 (transformers' per_layer_config), the last 18 layers reuse the
# K/V of the last earlier layer of their type (no storage of their own).
GEMMA4_E4B = {
    "num_hidden_layers": 42,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "per_layer_config": {i: {"head_dim": 512} for i in range(5, 42, 6)},
    "num_kv_shared_layers": 18,
}

# DeepSeek-V3.2 (transformers' DeepseekV32Config defaults): 61 DSA layers, each an MLA latent of 512
# plus a 64-wide shared RoPE key and a 128-wide indexer key per token (jaxkv.layers.indexed).
DEEPSEEK_V32 = {
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "head_dim": 64,
    "layer_types": ["indexed_attention"] * 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

DEFAULT_MODELS = {
    "SmolLM2-135M": SMOLLM2_135M, "Gemma-3-270M": GEMMA3_270M, "Qwen3-Next-80B": QWEN3_NEXT_80B, "DeepSeek-V3.2": DEEPSEEK_V32,
    "Gemma-4-E4B": GEMMA4_E4B,
}  # fmt: skip
