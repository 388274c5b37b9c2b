"""Engines wing: the in-process engine (embedded), the HTTP engines for SGLang and vLLM (http), the vLLM server harness."""
