"""Hidden-state plumbing: sources of the target's aux features and logits (online, offline dumps, vLLM prefill
producers), the bounded buffer, the kept per-sequence store, vLLM's connector and preflight."""
