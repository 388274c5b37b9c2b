"""Drafter wing: the EAGLE-3 model, vocab map, TTT loss, hidden-state sources, batches, checkpoints, distributed, figures."""
