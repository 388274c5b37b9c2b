"""Stage 04's wing (how long are the answers, what does the length limit cut): the byte-level length scan,
censored fits, the remaining-run projection, verdicts and figures."""
