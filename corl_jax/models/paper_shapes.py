"""HF config.json shape fields of the paper's checkpoints (as published on the Hugging Face hub), by hub id.

Read by `corl_jax.compile_check` (abstract shapes) and `corl_jax.stand_ins` (`random:<hub id>` models).
"""

_QWEN = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
_LLAMA32 = dict(model_type="llama", vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5,
                max_position_embeddings=131072,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
PAPER_MODELS = {
    "Qwen/Qwen2.5-1.5B": dict(_QWEN, model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                              num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                              max_position_embeddings=131072),
    "Qwen/Qwen2.5-3B": dict(_QWEN, model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                            max_position_embeddings=32768),
    "Qwen/Qwen3-1.7B-Base": dict(_QWEN, model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=32768),
    "meta-llama/Llama-3.2-1B-Instruct": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "meta-llama/Llama-3.2-3B-Instruct": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                             num_attention_heads=24, num_key_value_heads=8, head_dim=128),
}
