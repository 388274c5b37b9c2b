"""eagle_lib: train EAGLE-3 speculative-decoding drafters, one tested module per notebook stage."""

__version__ = "0.1.0"
