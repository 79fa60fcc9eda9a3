"""bamboo-data: a user's text to the token shards bamboo-train reads, with the
Hugging Face tokenizer of their model."""
