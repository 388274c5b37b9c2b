"""Serving wing: export (SGLang + vLLM formats), preflight, offline speculative decoding, online measurement."""
