"""07's multi-turn study: regenerating every turn of the multi-turn B conversations (``each_turn``) vs their first
turn only, at equal training tokens, measured on held-out target generations that include later-turn prompts.

Data. When 03 already ran a dataset ``each_turn`` (its records carry ``turn``), both arms come from 03: the
single-turn arm takes every training conversation's turn 0, the multi-turn arm all turns (merged as 05 merges
them, `data.multiturn`). Otherwise (the toy: 03 answers the first turn) 07 regenerates each_turn itself, with
the embedded target and 03's sampling, for ``multiturn_conversations`` training conversations per dataset (turn 0
is 03's own record, so only later turns cost anything) and for up to ``multiturn_heldout`` held-out ones (ids
held out by `store.is_heldout`, read from the source: 02 keeps too few of them to measure later turns); its
records live in ``value/multiturn/<dataset>/`` and are resumed like 03's (`engines.turns`).

Arms: a common base (``multiturn_base_fraction`` of the other datasets' training tokens) plus the single-turn
sequences of the multi-turn datasets' training conversations, or plus the multi-turn sequences of the
regenerated ones, cut to equal tokens (`subsets.equalize`). Eval prompts: the held-out conversations' first
prompts (eval set ``<dataset>``) and later-turn prompts with the target's own history (``<dataset>:later``).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from eagle_lib import models, store
from eagle_lib.data import formats, multiturn, subsets
from eagle_lib.data.batches import Sequence
from eagle_lib.data_value import value_tables as tables
from eagle_lib.decoding.specdec import Prompt
from eagle_lib.engines import turns
from eagle_lib.serving import heldout_tau


def _records(path: Path) -> list[dict]:
    return store.read_jsonl(path) if path.exists() else []


def source_conversations(run_dir: Path, ds: str, encoder, keep, cap: int, max_prompt_tokens: int) -> dict:
    """id -> each_turn conversation record (02's layout) for source rows with ``keep(id)``, at most ``cap``."""
    src, _ = subsets.b_source(run_dir, ds)
    out: dict[str, dict] = {}
    for where, row, err in formats.iter_rows(src):
        rid = formats.record_id(src, where, row)
        if err or not keep(rid):
            continue
        try:
            conv = formats.adapt(row, src, where)
            cut = multiturn.split_turns(conv["messages"])
            ids = encoder.encode_prompt(cut[0], conv["tools"]) if cut else None
        except Exception:  # noqa: BLE001 - the same rows 02 drops or rejects: not part of the study
            continue
        if ids and len(ids) <= max_prompt_tokens:
            out[rid] = {"id": rid, "source": conv["source"], "messages": cut[0], "tools": conv["tools"],
                        "prompt_ids": ids, "followups": cut[1], "max_prompt_tokens": max_prompt_tokens}  # fmt: skip
        if cap and len(out) >= cap:
            break
    return out


class Regenerator:
    """The embedded target with 03's sampling; answers conversations each_turn into value/multiturn/<ds>/."""

    def __init__(self, st, tok, ds: str):
        from eagle_lib.engines.base import Sampling
        from eagle_lib.engines.embedded import EmbeddedEngine
        from eagle_lib.engines.resume import target_identity

        meta03 = store.read_json(st.cfg.out("infer", "meta.json"))
        target = getattr(st.decoder, "target", None) or models.load_target(st.cfg.shared)
        s = meta03["datasets"][next(iter(meta03["datasets"]))]["sampling"]
        stop = tuple(next(iter(meta03["datasets"].values()))["stop_token_ids"])
        p03 = meta03["params"]
        self.engine = EmbeddedEngine(target, Sampling(s["temperature"], s["top_p"], s["max_new_tokens"],
                                     s["seed"], stop), p03["batch_size"], p03["max_batch_tokens"])  # fmt: skip
        self.identity = target_identity(self.engine, st.cfg.shared, self.engine.check(tok))
        self.tok, self.stop = tok, list(stop)
        self.encoder, self.stop_strings = turns.encoder_for(st.cfg.out("data", "B", ds), tok, self.stop)

    def record(self, item, src) -> dict:
        out = item.output_ids
        return {"id": src.id, "source": src.source, "prompt_ids": src.prompt_ids, "output_ids": out,
                "text": self.tok.decode(out, skip_special_tokens=False), "finish_reason": item.finish_reason,
                "n_prompt_tokens": len(src.prompt_ids), "n_output_tokens": len(out),
                "sampling": self.engine.sampling.record(), "engine": self.engine.name, "target": self.identity,
                "stop_token_ids": self.stop, "conversation": src.conversation, "turn": src.turn}  # fmt: skip

    def run(self, convs: dict, ds_dir: Path) -> dict:
        from eagle_lib.engines.base import Request, Result

        def generate(todo) -> dict:
            by_id, recs, n = {x.id: x for x in todo}, [], Counter()
            for item in self.engine.generate([Request(x.id, x.prompt_ids) for x in todo]):
                if isinstance(item, Result):
                    recs.append(self.record(item, by_id[item.id]))
                    n["generated"] += 1
                    n["generated_tokens"] += len(item.output_ids)
            store.append_jsonl(ds_dir / "responses.jsonl", recs)
            return dict(n)

        return multiturn_run(convs, ds_dir, self, generate)


def multiturn_run(convs, ds_dir, rg, generate) -> dict:
    return turns.run_conversations(convs, ds_dir, ds_dir, rg.encoder, rg.stop_strings, rg.engine.sampling.record(),
                                   rg.identity, rg.stop, generate, "set_aside", True, merge=False)  # fmt: skip


def _seq(rid: str, ids: list[int], mask: list[int], max_len: int) -> Sequence | None:
    ids, mask = ids[:max_len], mask[:max_len]
    return Sequence(rid, ids, mask) if sum(mask[2:]) else None  # as 05: labels need two tokens before them


def arm_data(st, p, ds: str, tok, rg_box: list) -> tuple[list, list, list[dict], dict]:
    """(single-turn sequences, multi-turn sequences, held-out turn records, tally) of one dataset."""
    run, pct, max_len = st.cfg.run_dir, st.cfg.shared.heldout_percent, st.recipe["max_seq_len"]
    recs03 = _records(run / "infer" / ds / "responses.jsonl")
    held = lambda r: store.is_heldout(store.split_key(r), pct)  # noqa: E731
    stopped, stopped_held = (
        Counter(),
        Counter(),
    )  # when 03 ran each_turn its stops are in infer/<ds>/meta.json
    if any("turn" in r for r in recs03):  # 03 ran each_turn: both arms from 03
        train = [r for r in recs03 if not held(r)]
        multi_recs, held_recs, how = train, [r for r in recs03 if held(r)], "03 each_turn"
    else:
        if not rg_box:
            rg_box.append(Regenerator(st, tok, ds))
        rg, out = rg_box[0], st.out / "multiturn" / ds
        train = [r for r in recs03 if not held(r)]
        order = sorted(train, key=lambda r: subsets.order_key(st.cfg.shared.seed, str(r["id"])))
        want = {str(r["id"]) for r in order[: p.multiturn_conversations]}
        m02 = store.read_json(run / "data" / "B" / ds / "meta.json")["params"]
        mx = m02["max_seq_len"] - m02["max_new_tokens"]  # 02's room rule: each prompt + the generation budget
        convs = source_conversations(run, ds, rg.encoder, want.__contains__, 0, mx)
        by_id = {str(r["id"]): r for r in recs03}
        seeds = [by_id[c] | {"id": multiturn.turn_id(c, 0), "conversation": c, "turn": 0} for c in convs
                 if by_id[c]["prompt_ids"] == convs[c]["prompt_ids"]]  # fmt: skip
        have = {r["id"] for r in _records(out / "responses.jsonl")}
        store.append_jsonl(out / "responses.jsonl", [r for r in seeds if r["id"] not in have])
        stopped = Counter(rg.run(convs, out)["stopped"].values())  # why each conversation ended
        hconvs = source_conversations(run, ds, rg.encoder, lambda i: store.is_heldout(i, pct), p.multiturn_heldout,
                                      mx)  # fmt: skip
        hout = st.out / "multiturn" / f"{ds}.heldout"
        stopped_held = Counter(rg.run(hconvs, hout)["stopped"].values())
        multi_recs, held_recs, how = (
            _records(out / "responses.jsonl"),
            _records(hout / "responses.jsonl"),
            "07",
        )
    single = [_seq(str(r["id"]), r["prompt_ids"] + r["output_ids"], [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]), max_len)
              for r in train if r.get("turn", 0) == 0]  # fmt: skip
    multi = [_seq(rec["id"], ids, mask, max_len) for rec, ids, mask in multiturn.training_records(multi_recs)]
    single, multi = [s for s in single if s], [s for s in multi if s]
    no_dump = 0
    if (
        st.trainer.keep is not None
    ):  # offline dumps: each sequence needs its own dump (the others are counted)
        n = len(single) + len(multi)
        single, multi = (
            [s for s in single if st.trainer.keep(s.input_ids)],
            [s for s in multi if st.trainer.keep(s.input_ids)],
        )
        no_dump = n - len(single) - len(multi)
    tally = {"source": how, "single_sequences": len(single), "multi_conversations": len({s.id.split(multiturn.SEP)[0] for s in multi}),
             "multi_turns": sum(1 for r in multi_recs if "turn" in r), "heldout_conversations": len({r["conversation"] for r in held_recs}),
             "stopped": dict(stopped), "stopped_heldout": dict(stopped_held), "no_hidden_dump": no_dump}  # fmt: skip
    return single, multi, held_recs, tally


def eval_prompts(held: dict[str, list[dict]], per_dataset: int, max_tokens: int) -> list[Prompt]:
    """First-turn prompts (eval set <ds>) and later-turn prompts (<ds>:later) of the held-out conversations."""
    out = []
    for ds, recs in held.items():
        for label, keep in ((ds, lambda r: r["turn"] == 0), (f"{ds}:later", lambda r: r["turn"] > 0)):
            qs = [
                r
                for r in sorted(recs, key=lambda r: r["id"])
                if keep(r) and len(r["prompt_ids"]) <= max_tokens
            ]
            out += [Prompt(r["id"], label, list(r["prompt_ids"])) for r in qs[:per_dataset]]
    return out


def study(st, p):
    """(table per eval set: tau single vs multi and the paired difference, tally); empty when nothing to compare."""
    import pandas as pd

    t0, tok, rg_box = time.time(), models.load_tokenizer(st.cfg.shared), []
    single, multi, held, tally = [], [], {}, {}
    for ds in [d for d in p.multiturn_datasets if d in st.groups]:
        s, m, h, tally[ds] = arm_data(st, p, ds, tok, rg_box)
        single, multi, held[ds] = single + s, multi + m, h
    prompts = eval_prompts(held, p.max_prompts_per_dataset, p.max_prompt_tokens)
    if not multi or not single or not prompts:
        return pd.DataFrame(), tally | {"skipped": "no multi-turn data or no held-out prompts"}
    tally["regen_seconds"] = round(time.time() - t0, 1)
    single, multi = subsets.equalize(single, multi, st.cfg.shared.seed)
    others = {d: v for d, v in st.groups.items() if d not in p.multiturn_datasets}
    base = subsets.fraction_subset(others, p.multiturn_base_fraction) if others else []
    if p.tau_source == "ttt":  # teacher-forced chain tau on the held-out turns themselves (prompt + answer)
        by_id = {r["id"]: r for recs in held.values() for r in recs}
        seqs = [_seq(q.id, by_id[q.id]["prompt_ids"] + by_id[q.id]["output_ids"],
                     [0] * len(q.prompt_ids) + [1] * by_id[q.id]["n_output_tokens"], st.recipe["max_seq_len"])
                for q in prompts]  # fmt: skip
        kept = [(s, q.dataset) for s, q in zip(seqs, prompts, strict=True) if s]
        dec = heldout_tau.TeacherForced(st.trainer, [s for s, _ in kept], [d for _, d in kept], p.num_steps)
    else:
        eos = models.stop_ids(tok, st.decoder.target)
        dec = heldout_tau.Decoder(st.decoder.target, prompts, p.eval_max_new_tokens, p.num_steps, eos)
    st.train_side_by_side([("single_turn", base + single, None), ("multi_turn", base + multi, None)])
    st.arm("single_turn", "multiturn", base + single, decoder=dec)
    st.arm("multi_turn", "multiturn", base + multi, decoder=dec)
    tally |= {"eval_prompts": dict(Counter(q.dataset for q in prompts)), "arm_tokens": subsets.tokens(single)}
    df = tables.pair_table(st, "multi_turn", "single_turn", p, sums=dec.sums)
    return pd.concat(
        [df, pd.DataFrame([_later(dec.sums, p, st.cfg.shared.seed, st.noise)])], ignore_index=True
    ), tally


def _later(s, p, seed: int, noise=None) -> dict:
    """The later-turn prompts of every dataset pooled (resampled within datasets), as one more row "later"."""
    from eagle_lib.data_value import curve as curves

    cols = [k for k, d in enumerate(s.datasets) if d.endswith(":later")]
    if not cols:
        return {"eval": "later", "measurable": False}
    num, den = s.rows(["multi_turn", "single_turn"])
    num, den = num[:, cols], den[:, cols]
    draws = curves.bootstrap_draws(len(cols), p.bootstrap_reps, seed, [s.datasets[k] for k in cols])
    d = curves.diff_interval(num, den, 0, 1, draws, noise=noise or curves.NO_NOISE, seed=seed)
    taus = num.sum(axis=1) / den.sum(axis=1).clip(min=1)
    return {"eval": "later", "tau_multi_turn": taus[0], "tau_single_turn": taus[1], "diff": d["diff"], "lo": d["lo"],
            "hi": d["hi"], "measurable": d["measurable"]}  # fmt: skip


def text(df) -> str:
    """The comparison in words on all held-out prompts and on the later-turn ones; "no measurable difference"
    where the interval includes 0."""
    if not len(df):
        return "multi-turn vs single-turn regeneration: not run (no multi-turn B data)"
    parts = []
    for ev, label in (("all", "all held-out prompts"), ("later", "later-turn prompts")):
        rows = df[df["eval"] == ev]
        if not len(rows) or rows.iloc[0].get("diff") != rows.iloc[0].get("diff"):
            continue
        r = rows.iloc[0]
        if r.lo != r.lo:  # NaN: fewer prompts than an interval needs
            parts.append(f"{label}: {r['diff']:+.3f}, too few prompts for an interval")
            continue
        iv = f"{r['diff']:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]"
        what = (
            f"tau {r.tau_multi_turn:.2f} vs {r.tau_single_turn:.2f}"
            if r.measurable
            else "no measurable difference"
        )
        parts.append(f"{label}: {what} ({iv})")
    return "multi-turn vs single-turn regeneration at equal training tokens: " + "; ".join(parts)


def headline(df, tally: dict) -> dict:
    if not len(df):
        return {"multiturn": {"run": False, **{k: v for k, v in tally.items() if k == "skipped"}}}
    r = df[df["eval"] == "all"].iloc[0]
    rows = {
        e.eval: {"diff": e.diff, "lo": e.lo, "hi": e.hi, "measurable": bool(e.measurable)}
        for e in df.itertuples()
    }
    return {"multiturn": {"run": True, "tau_multi_turn": r.tau_multi_turn, "tau_single_turn": r.tau_single_turn,
                          "by_eval": rows, "text": text(df), "tally": tally}}  # fmt: skip
