"""Where targets come from: the URI schemes (``uris.resolve``: the toy worlds, ``pypi://``, GGUF), a file inside an
installed package (``packaged``) and a GGUF model turned into a plain HF directory once (``gguf_target``).
``eagle_lib.models`` loads what ``uris.resolve`` returns."""
