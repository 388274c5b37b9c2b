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
