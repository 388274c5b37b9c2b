"""Targets that arrive as files: a file inside an installed package (``pypi://``) and a GGUF model turned into a
plain HF directory once (``gguf_target``). ``eagle_lib.models.resolve`` sends target strings here."""
