"""benchmarks/real_seeds.py: the README's seed table is the mean and range of each run's own 06 files."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import real_seeds  # noqa: E402


def _run(root: Path, name: str, tau: float, online: float, speed: tuple[float, float]) -> Path:
    ev = root / name / "eval"
    ev.mkdir(parents=True)
    (ev / "tau.csv").write_text(f"method,temperature,dataset,tau\neagle3,0.0,all,{tau}\nngram,0.0,all,1.5\n")
    (ev / "online.csv").write_text(
        f"temperature,dataset,engine,online_tau,greedy_equal\n0.0,all,vllm,{online},1.0\n"
    )
    (ev / "served_speed.csv").write_text(
        f"temperature,dataset,tokens_per_s,tokens_per_s_no_draft,speedup\n0.0,all,{speed[0]},{speed[1]},"
        f"{speed[0] / speed[1]}\n"
    )
    return root / name


def test_cells_are_mean_and_range_over_the_runs(tmp_path):
    runs = [_run(tmp_path, "a", 1.2, 1.1, (10.0, 8.0)), _run(tmp_path, "b", 1.4, 1.3, (12.0, 12.0))]
    text = real_seeds.table(runs)
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[-1].strip(" |") for line in text.splitlines()[2:]
    }
    assert rows["eagle3 T=0, offline"] == "1.30 (1.20-1.40)"  # (1.2 + 1.4) / 2
    assert rows["eagle3 T=0, served by vllm"] == "1.20 (1.10-1.30)"
    assert rows["ngram T=0, offline"] == "1.50 (1.50-1.50)"
    assert rows["served speedup T=0"] == "1.12 (1.00-1.25)"  # 10/8 and 12/12
    assert "speedup" not in real_seeds.table(runs, speed=False)
    # a run without an eval set: its cell says how many runs have it
    assert real_seeds.cell([1.25], 3) == "1.25 [1]"
