"""DeepSeek V3.2 (`DeepseekV32ForCausalLM`): DeepSeek V3 with DeepSeek Sparse Attention."""
