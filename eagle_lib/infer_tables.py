"""Stage 03's report tables and text from its meta.json: per dataset, finish reasons, per server; the report's
first sentence and a preview of the answers."""

from __future__ import annotations

from eagle_lib import params, store


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


def headline(meta: dict) -> dict:
    """The numbers the notebook records: counts, tokens, speed, share of answers cut by max_new_tokens."""
    n = max(meta["kept"], 1)
    return {
        "prompts": meta["read"], "responses": meta["kept"], "errors": meta["rejected"],
        "output_tokens": meta["output_tokens"], "mean_output_tokens": round(meta["output_tokens"] / n, 2),
        "tokens_per_s": meta["tokens_per_s"], "length_share": round(meta["finish_reason"].get("length", 0) / n, 4),
        "engine": meta["probe"]["engine"],
    }  # fmt: skip


def answer_text(meta: dict, limit_share: float = 0.05) -> str:
    """The report's first sentence: prompts answered, errors, tokens and speed, datasets cut at the limit."""
    h, ds = headline(meta), meta["datasets"]
    cut = [n for n, m in ds.items() if m["finish_reason"].get("length", 0) > limit_share * max(m["kept"], 1)]
    text = (f"**{h['responses']:,} of {h['prompts']:,} prompts answered** ({h['errors']:,} errors) in {len(ds)} "
            f"datasets: {h['output_tokens']:,} output tokens at {h['tokens_per_s']:,.0f} tokens/s ({h['engine']}); ")  # fmt: skip
    if cut:
        return text + (f"{len(cut)} dataset(s) cut at max_new_tokens in > {limit_share:.0%} of responses "
                       f"({', '.join(cut)}): raise max_new_tokens (04 has the details).")  # fmt: skip
    return text + f"no dataset cut at max_new_tokens in > {limit_share:.0%} of responses."


def answer(meta: dict):
    """answer_text as Markdown, for the notebook."""
    from IPython.display import Markdown

    return Markdown(answer_text(meta))


def preview(cfg: params.StageConfig, n_chars: int = 400) -> str:
    """The first response of each dataset, as text, for a human look at what the target wrote."""
    parts = []
    for f in sorted(cfg.out("infer").glob("*/responses.jsonl")):
        rec = next(store.iter_jsonl(f), None)
        if rec:
            parts.append(
                f"== {f.parent.name} / {rec['id']} ({rec['finish_reason']}, {rec['n_output_tokens']} tokens)\n"
                f"{rec['text'][:n_chars]}"
            )
    return "\n\n".join(parts)
