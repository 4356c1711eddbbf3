"""DeepSeek V2 / V3: MLA attention, routed experts, and its MTP layer."""
