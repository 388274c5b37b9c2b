"""Where a target string points, the one home of the URI schemes: ``toy://`` URIs to the embedded worlds (built on
first use, `eagle_lib.toy`), a GGUF file (a path or ``pypi://``) to its converted HF directory (converted once,
`eagle_lib.targets.gguf_target`), other ``pypi://`` URIs to the file they name (`eagle_lib.targets.packaged`);
anything else (an HF model dir or hub id) passes through. `eagle_lib.models` loads what this returns.

Nothing is imported until a URI needs it: the toy world imports torch, and validating params must not.
"""

from __future__ import annotations


def resolve(uri: str) -> str:
    """Map toy:// URIs to local paths (building the toy world if needed), a GGUF file (local or pypi://) to its
    converted HF directory (converting it once, ``eagle_lib.targets.gguf_target``) and other pypi:// URIs to the
    file they name; other strings pass through."""
    if uri.startswith("toy://"):
        from eagle_lib import toy

        return toy.resolve(uri)
    from eagle_lib.targets import gguf_target, packaged

    if gguf_target.is_gguf(uri):
        return gguf_target.resolve(uri)
    if packaged.is_packaged(uri):
        return packaged.resolve(uri)
    return uri
