"""Shared test support (not test modules): tiny models and worlds, the SGLang stand-in server, drafter factories."""
