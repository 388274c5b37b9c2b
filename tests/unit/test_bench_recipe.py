"""benchmarks/bench_recipe.py's seed table: per-variant mean and spread across seeds, against statistics."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_recipe  # noqa: E402


def test_seed_table_states_each_seed_the_mean_the_sample_sd_and_the_paired_difference():
    rows = [
        {"variant": "baseline", "seed": 0, "tau": 3.70},
        {"variant": "baseline", "seed": 1, "tau": 3.76},
        {"variant": "baseline", "seed": 2, "tau": 3.64},
        {"variant": "muon", "seed": 0, "tau": 3.80},
        {"variant": "muon", "seed": 2, "tau": 3.71},
        {"variant": "solo", "seed": 5, "tau": 3.5},
    ]
    lines = bench_recipe.seed_table(rows).splitlines()
    assert len(lines) == 5
    base, muon, solo = (ln.split("|")[1:-1] for ln in lines[2:])
    assert base[0].strip() == "baseline" and base[1].strip() == "0: 3.700, 1: 3.760, 2: 3.640"
    assert float(base[2]) == round(statistics.mean([3.70, 3.76, 3.64]), 3)
    assert float(base[3]) == round(statistics.stdev([3.70, 3.76, 3.64]), 3)
    assert base[4].strip() == ""
    # muon ran seeds 0 and 2: compared with baseline's same seeds ((0.10 + 0.07) / 2), not with its mean
    assert muon[4].strip() == "+0.085 (2 seeds)"
    assert float(muon[3]) == round(statistics.stdev([3.80, 3.71]), 3)
    assert solo[3].strip() == "" and solo[4].strip() == ""  # one seed: no spread, no shared seed


def test_the_speculators_worker_names_the_trained_layers_as_its_readers_read_them():
    """bench_quality's speculators worker trains on `aux_layers` and writes `config_aux_ids` into the saved
    config; our reader of that config (as vLLM reads it: speculators' key is 1-based) must get the trained
    layers back. The old worker wrote the trained ids themselves: the reader then got [0, 2, 5]."""
    import bench_quality

    from eagle_lib.drafter import export

    spec = bench_quality.worker_spec([1, 3, 6])
    assert spec["aux_layers"] == [1, 3, 6] and spec["config_aux_ids"] == [
        2,
        4,
        7,
    ]  # vLLM: hidden_states[i + 1]
    assert export.aux_layers_of(
        "speculators", {"eagle_aux_hidden_state_layer_ids": spec["config_aux_ids"]}
    ) == [
        1,
        3,
        6,
    ]


def test_the_kimi_variants_override_the_mini_kimi_params_into_a_one_process_cpu_run(tmp_path):
    """--params params/mini_kimi.yaml: the kimi_* variants take that file's shared and 05 sections (not the toy's)
    and turn its cluster settings (vLLM producers, FSDP on 2 ranks, bf16) into one CPU process; they differ only
    in the draft layer's attention."""
    root = Path(bench_recipe.ROOT)
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "infer").mkdir()
    cfgs = {
        name: bench_recipe.stage_config(
            run,
            tmp_path / name,
            50,
            dict(bench_recipe.VARIANTS[name]),
            0,
            1,
            root / "params" / "mini_kimi.yaml",
        )  # fmt: skip
        for name in ("kimi_gqa", "kimi_mla")
    }
    gqa, mla = cfgs["kimi_gqa"], cfgs["kimi_mla"]
    assert gqa.shared.target == "toy://kimi" and gqa.shared.seed == 1 and gqa.shared.trust_remote_code
    assert (gqa.stage.hidden_source, gqa.stage.nproc_per_node, gqa.stage.precision) == ("online", 1, "fp32")
    assert gqa.stage.max_steps == 50 and gqa.stage.aux_layers == [1, 3, 4]  # mini_kimi.yaml's own aux layers
    assert (gqa.stage.draft_attention, mla.stage.draft_attention) == ("gqa", "mla")
    assert gqa.stage.model_copy(update={"draft_attention": "mla"}) == mla.stage
