"""DeepSeek V4: hybrid (sliding / compressed) attention, hyper-connections, hashed and
routed experts, and its MTP layer."""
