"""The whole ci.yaml run: every stage ran and left its report, HTML and meta.json."""

import json

from eagle_lib.params import STAGES
from eagle_lib.pipeline import REPO_ROOT
from eagle_lib.store import check_tally, read_json


def test_every_existing_stage_left_a_report(ci_run):
    man = json.loads((ci_run / "manifest.json").read_text())
    stages = [s for s in STAGES.values() if (REPO_ROOT / s.notebook).exists()]
    assert stages, "no stage notebooks"
    for s in stages:
        entry = man["stages"][s.name]
        assert entry["status"] in {"complete", "skipped"}, s.name
        assert (ci_run / "reports" / f"{s.name}.ipynb").exists()
        assert (ci_run / "reports" / f"{s.name}.html").exists()
        for out in s.outputs:
            meta = read_json(ci_run / out / "meta.json")
            if "read" in meta:
                check_tally(meta, str(ci_run / out / "meta.json"))


def test_reports_have_no_stderr_cells_and_iso_times(ci_run):
    """Reports read at a glance: no stderr output cell in any executed notebook (progress bars, load chatter,
    tqdm's IProgress warning), and every stage meta stamps its times in one format (ISO-8601)."""
    from datetime import datetime

    for s in STAGES.values():
        nb_path = ci_run / "reports" / f"{s.name}.ipynb"
        if not nb_path.exists():
            continue
        nb = json.loads(nb_path.read_text())
        noise = [
            (i, "".join(o.get("text", ""))[:120])
            for i, c in enumerate(nb["cells"])
            for o in c.get("outputs", [])
            if o.get("name") == "stderr"
        ]
        assert not noise, f"{s.name}: stderr output cells {noise}"
        for out in s.outputs:
            meta = read_json(ci_run / out / "meta.json")
            for key in ("started", "finished"):
                if key in meta:
                    datetime.fromisoformat(meta[key])  # raises on an epoch float or another format
