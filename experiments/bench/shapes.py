"""Model shapes of the GPU benchmarks: family -> HF config.json fields (random weights are drawn for them).

The same shapes as ../shared/bench/hf_generate_bench.py, so our figures and the transformers peer's line up.
"""

SHAPES = {
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                   tie_word_embeddings=True)),
    "llama3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                  max_position_embeddings=131072)),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                 max_position_embeddings=40960)),
    # for a quick check of the scripts on a CPU
    "tiny": ("qwen3", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}
