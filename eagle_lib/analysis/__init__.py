"""Analysis wing: the byte-level length scan (scan) and the verdicts and figures built on it (verdicts)."""
