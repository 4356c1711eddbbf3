"""The Llama family (Llama, Mistral, Qwen2 / Qwen3) and its MTP draft head."""
