"""Drafter wing: the EAGLE-3 model, vocab map, TTT loss, recipe and training loop, checkpoints, the exports
(SGLang + speculators formats), figures (the hidden-state sources are eagle_lib.hidden_states, the training
sequences eagle_lib.data.batches, the torchrun plumbing eagle_lib.distributed)."""
