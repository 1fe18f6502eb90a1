"""Model files into model parameters: GGUF, HF safetensors directories, orbax caches, tokenizers."""
