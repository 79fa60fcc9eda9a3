"""The named sizes of Hugging Face models (`--model hf:NAME`), apart from the code
that builds them, so that --help can list them without importing transformers."""

# Named sizes: `gpt2` is GPT-2 small's 124M shape; the llama shapes follow
# TinyLlama (1.1B) and a 160M Llama; the tiny ones are for tests and demos.
NAMED = {
    "gpt2-tiny": {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 128,
                  "vocab_size": 512, "bos_token_id": 511, "eos_token_id": 511},
    "gpt2": {"model_type": "gpt2"},
    "gpt2-medium": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16},
    "gpt2-large": {"model_type": "gpt2", "n_embd": 1280, "n_layer": 36, "n_head": 20},
    "llama-tiny": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "vocab_size": 512},
    "llama": {"model_type": "llama", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 2048,
              "vocab_size": 32000},
    "llama-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                 "vocab_size": 32000},
}
