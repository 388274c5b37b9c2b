"""Decoding wing: offline speculative decoding (specdec: the target verifies every proposer's drafts) and the
target's sampling with the accept/reject rule that keeps its output distribution exact (sampling). Stage 05
measures its drafter with it during training (`eagle_lib.drafter.measure`) and stage 06 evaluates with it
(`eagle_lib.serving`)."""
