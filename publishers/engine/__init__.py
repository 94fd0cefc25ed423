"""Engine simulator: a GPU-less vLLM look-alike (tokenizer, KV block manager, timing model)."""
