"""Layers the model families share: linear, norms, rotary, attention glue, MLA, MoE,
the MLP, the decoder stack and quantized-weight helpers."""
