"""Prompt tokenization shared by the router and the engine simulator: a model directory's HF
tokenizer and chat template giving the ids vLLM gives (``tokenizer``), and the fast paths
that encode long prompts (``prompt_encoder``, ``fast_bpe``). It depends on no other package
of this repository."""
