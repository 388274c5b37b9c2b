"""Preflight loads the target's hub config at the pinned commit (issue 42, item 9): `target_text_config`, the
``--params`` path with ``--vllm-hidden`` and 06's config for a target it does not load (``offline: false``)."""

from __future__ import annotations

from pathlib import Path

import yaml
from transformers import LlamaConfig

from eagle_lib import models, params
from eagle_lib.hidden_states import vllm_preflight
from eagle_lib.serving import preflight

ROOT = Path(__file__).resolve().parents[2]
PIN = "0123456789abcdef0123456789abcdef01234567"


def _capture(monkeypatch) -> list[dict]:
    """models.load_config recording what it was asked for, answering with a small Llama config."""
    calls: list[dict] = []

    def load_config(target, trust_remote_code=False, revision=None):
        calls.append({"target": target, "trust_remote_code": trust_remote_code, "revision": revision})
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=1000)  # fmt: skip

    monkeypatch.setattr(models, "load_config", load_config)
    return calls


def _pinned_kimi(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "params" / "kimi_k25.yaml").read_text())
    cfg["shared"]["revision"] = PIN
    out = tmp_path / "kimi_pinned.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def test_target_text_config_loads_the_given_commit(monkeypatch):
    calls = _capture(monkeypatch)
    assert preflight.target_text_config("moonshotai/Kimi-K2.5", True, PIN)["num_hidden_layers"] == 8
    assert calls == [{"target": "moonshotai/Kimi-K2.5", "trust_remote_code": True, "revision": PIN}]


def test_preflight_with_params_and_vllm_hidden_uses_the_pinned_commit(tmp_path, monkeypatch):
    calls = _capture(monkeypatch)
    probed: list = []

    def check(target, aux=None, trust_remote_code=False, python=None, revision=""):
        probed.append((target, revision))
        return []

    monkeypatch.setattr(vllm_preflight, "check", check)
    rc = preflight.main(
        [str(tmp_path / "no_export"), "--params", str(_pinned_kimi(tmp_path)), "--vllm-hidden"]
    )
    assert rc == 1  # no export there: the config check fails, the rest still runs
    assert [c["revision"] for c in calls] == [PIN] and calls[0]["target"] == "moonshotai/Kimi-K2.5"
    assert probed == [("moonshotai/Kimi-K2.5", PIN)]


def test_06_target_config_without_loading_it_uses_the_pinned_commit(tmp_path, monkeypatch):
    from eagle_lib import acceptance

    calls = _capture(monkeypatch)
    run = params.load_params(_pinned_kimi(tmp_path))
    cfg = params.StageConfig("06_eval_acceptance", tmp_path, run.shared, run.stage("06_eval_acceptance"))
    target, drafter, tcfg = acceptance._models(cfg, tmp_path / "drafter")
    assert target is None and drafter is None and tcfg["hidden_size"] == 64
    assert calls == [{"target": "moonshotai/Kimi-K2.5", "trust_remote_code": True, "revision": PIN}]
