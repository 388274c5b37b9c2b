"""Serving wing: preflight, serving commands, online measurement, stage 06's tables and figures (the exports are
eagle_lib.drafter.export, offline speculative decoding eagle_lib.decoding)."""
