"""Stage 03's report tables from its meta.json: per dataset, finish reasons, per server."""

from __future__ import annotations


def summary_table(meta: dict):
    """Per dataset: prompts, responses, errors (responses + errors = prompts), tokens, speed; plus TOTAL."""
    import pandas as pd

    cols = ["read", "kept", "rejected", "resumed", "generated", "output_tokens", "mean_output_tokens",
            "max_output_tokens", "tokens_per_s", "retries"]  # fmt: skip
    df = pd.DataFrame([{"dataset": n, **{c: m[c] for c in cols}} for n, m in meta["datasets"].items()])
    total = {
        c: df[c].sum()
        for c in ("read", "kept", "rejected", "resumed", "generated", "output_tokens", "retries")
    }
    total |= {"mean_output_tokens": round(meta["output_tokens"] / max(meta["kept"], 1), 2),
              "max_output_tokens": df["max_output_tokens"].max(), "tokens_per_s": meta["tokens_per_s"]}  # fmt: skip
    df = pd.concat([df, pd.DataFrame([{"dataset": "TOTAL", **total}])], ignore_index=True)
    return df.rename(columns={"read": "prompts", "kept": "responses", "rejected": "errors"})


def finish_table(meta: dict):
    """finish_reason counts and shares per dataset (a high "length" share means max_new_tokens cuts answers)."""
    import pandas as pd

    rows = []
    for name, m in meta["datasets"].items():
        fr, n = m["finish_reason"], max(m["kept"], 1)
        rows.append(
            {
                "dataset": name,
                "stop": fr.get("stop", 0),
                "length": fr.get("length", 0),
                "length_share": round(fr.get("length", 0) / n, 4),
            }
        )
    return pd.DataFrame(rows)


def servers_table(meta: dict):
    """03's per-server accounting (HTTP engines), one row a server."""
    import pandas as pd

    rows = [{**{k: v for k, v in r.items() if k != "failures"}, "failures": ", ".join(f"{k} {n}" for k, n in r["failures"].items()) or "-"}
            for r in meta.get("servers") or []]  # fmt: skip
    return pd.DataFrame(rows) if rows else pd.DataFrame([{"servers": "embedded engine: no servers"}])
