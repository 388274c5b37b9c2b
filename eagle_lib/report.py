"""Headline numbers of a stage: shown in the notebook, saved beside the outputs, read back by tests.

`record(cfg, {...})` is the last cell of every notebook. The numbers are written to
<run_dir>/metrics/<stage>.json and embedded in the executed notebook as a display output with a custom
MIME type, so `read_notebook_metrics(path)` recovers them from the report itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eagle_lib.store import write_json

MIME = "application/vnd.eagle-lib.metrics+json"


def _clean(v: Any) -> Any:
    """JSON-safe copy: numpy scalars -> Python, NaN/inf -> None."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def record(cfg, metrics: dict[str, Any]) -> dict[str, Any]:
    """Record a stage's headline numbers (merged with earlier ones of the same stage run)."""
    metrics = _clean(metrics)
    path = Path(cfg.run_dir) / "metrics" / f"{cfg.name}.json"
    write_json(path, metrics)
    try:
        from IPython.display import display

        display({MIME: metrics, "text/plain": json.dumps(metrics, indent=2)}, raw=True)
    except ImportError:  # outside Jupyter
        print(json.dumps(metrics, indent=2))
    return metrics


def read_notebook_metrics(nb_path: str | Path) -> dict[str, Any]:
    """The numbers recorded by `record` in an executed notebook (last one wins)."""
    nb = json.loads(Path(nb_path).read_text())
    found: dict[str, Any] = {}
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME in data:
                found.update(data[MIME])
    if not found:
        raise KeyError(f"{nb_path}: no recorded metrics (the notebook's last cell calls report.record)")
    return found


def save_figure(fig, path: str | Path):
    """Save a report figure as PNG beside the outputs and close it (a notebook cell returning ``fig`` shows it
    once, not twice); returns ``fig``. The one figure writer of every stage."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return fig
