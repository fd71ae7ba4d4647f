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

DEFAULT_MODELS = {"SmolLM2-135M": SMOLLM2_135M, "Gemma-3-270M": GEMMA3_270M}
