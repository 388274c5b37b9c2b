"""Drafter wing: the EAGLE-3 model, vocab map, TTT loss, recipe and training loop, batches, checkpoints, distributed,
figures (the hidden-state sources are eagle_lib.hidden_states)."""
