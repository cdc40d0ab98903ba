"""Qwen-Image-2.1: its attention processors, prefill, fused projections, prefix KV cache and context-parallel plan."""
