"""Where a drafter's sampled-temperature acceptance goes: teacher-forced per-draft acceptance at each served T > 0
against the acceptance measured by decoding (06).

For a run's 05 drafter (``--drafter``: another drafter directory), on held-out sequences of ``--run-dir`` (or of
``--sequences-from``, another run of the same world, e.g. one whose 03 sampled at T=1: the same held-out prompts
answered otherwise), prints per TTT position the teacher-forced acceptance rate of a draft drawn from the drafter
(1 - TV between the target's served distribution, softmax(logits / T) cut to its nucleus, restricted to the draft
vocab, and softmax(draft logits / T): `eagle_lib.drafter.served`, the loss ``tv`` evaluated by 05's own
`ttt.evaluate`, over the labels whose target argmax is a draft id, as 05's loss), the draft vocab's share of the target's served distribution on those labels (the ceiling of that
rate), and, beside them, the first-draft acceptance and tau 06 measured by decoding at that temperature
(``metrics/06_eval_acceptance.json``, where present). A teacher-forced rate well above the decoded one says the
decoded cycles start where the drafter is weakest (after a rejection), not that the drafter misfits the labels.
With ``--decode-reps R`` it also decodes 06's held-out prompts (``--per-dataset``, ``--new-tokens``, R sampling seeds
a prompt, probabilistic drafts, `eagle_lib.serving.specdec` as 06 decodes) and splits the first draft's acceptance
by how the cycle before ended: all drafts accepted (the next token drawn from the target's own distribution) or a
rejection (the next token drawn from the residual max(0, p - q)).

    .venv/bin/python benchmarks/diag_served.py --run-dir outputs/toy [--sequences-from outputs/toy_t1] \
        [--decode-reps 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--run-dir", required=True, help="a run whose 05 trained the drafter (its recipe is read)"
    )
    ap.add_argument("--drafter", default=None, help="drafter directory (default: <run-dir>/drafter/final)")
    ap.add_argument("--sequences-from", default=None, help="another run dir whose held-out sequences to read")
    ap.add_argument(
        "--decode-reps", type=int, default=0, help="sampling seeds a prompt to decode (0: no decode)"
    )
    ap.add_argument(
        "--per-dataset", type=int, default=8, help="held-out prompts per dataset (06's toy value)"
    )
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt (06's toy value)")
    a = ap.parse_args()

    from eagle_lib.drafter import retrain, served, ttt
    from eagle_lib.drafter.model import load_drafter

    run = Path(a.run_dir)
    tr = retrain.Trainer(*retrain.load_recipe(run))
    src = Path(a.sequences_from or run)
    if a.sequences_from and not (src / "drafter" / "meta.json").exists():
        raise SystemExit(
            f"{src}: no drafter/meta.json; the held-out split is read with {run}'s 05 recipe, copy it"
        )
    _, held, _ = tr.sequences(src, max_eval=0)
    drafter = load_drafter(Path(a.drafter or run / "drafter" / "final")).eval()
    temps = [t for t in tr.shared.serve_temperatures if t > 0] or [1.0]
    decoded = {}
    m06 = run / "metrics" / "06_eval_acceptance.json"
    if m06.exists():
        decoded = json.loads(m06.read_text())
    print(f"{len(held)} held-out sequences of {src}; drafter {a.drafter or run / 'drafter' / 'final'}")
    for t in temps:
        term = served.Term(t, t, t, tr.shared.serve_top_p, "tv", 1.0)
        model = ttt.TTT(drafter, tr.k, 1.0, tr.attention, tr.p.ttt_input, terms=[term])
        m = ttt.evaluate(model, tr.source, held, tr.p.pack_len, tr.p.rows_per_batch, tr.device, False)
        alpha = [1 - x for x in m["loss"]]
        mass = m["served_vocab_mass"][ttt.SAMPLED.format(t)]
        line = f"T={t:g} top_p {tr.shared.serve_top_p}: teacher-forced acceptance per draft " + " / ".join(
            f"{x:.3f}" for x in alpha
        )
        line += f"; draft vocab's share of the served distribution {mass:.3f}"
        d = decoded.get(f"eagle3_T={t:g}")
        if d:
            acc = d["acc"]
            cond = [acc[0]] + [
                acc[i] / acc[i - 1] if acc[i - 1] else float("nan") for i in range(1, len(acc))
            ]
            line += "; 06 decoded: acceptance per draft given the ones before " + " / ".join(
                f"{x:.3f}" for x in cond
            )
            line += f", tau {d['tau']['all']:.3f}"
        print(line)
        if a.decode_reps:
            print(after_what(run, tr, drafter, t, a))


def after_what(run: Path, tr, drafter, t: float, a) -> str:
    """The first draft's acceptance by how the cycle before ended, decoding 06's held-out prompts at T=t."""
    import torch

    from eagle_lib import models
    from eagle_lib.serving import heldout_tau, specdec

    torch.set_num_threads(1)
    target = models.load_target(tr.shared, device="cpu")
    eos = models.stop_ids(models.load_tokenizer(tr.shared), target)
    prompts, _ = heldout_tau.heldout_prompts(run, tr.shared.heldout_percent, a.per_dataset, 768)
    decoder = heldout_tau.Decoder(target, prompts, a.new_tokens, tr.k, eos)  # 06's decode, its sampling seeds
    num, den = decoder.decode(drafter, t, tr.shared.serve_top_p, "probabilistic", a.decode_reps)
    tokens, steps = num.sum(), den.sum()
    counts = specdec.first_draft_by_cycle_start((g.matched, g.drafted) for g in decoder.generations)
    parts = [f"{how} {n / c:.3f} of {c}" for how, (n, c) in counts.items() if c]
    return (
        f"  decoded ({len(prompts)} prompts x {a.decode_reps} seeds, tau {tokens / steps:.3f}): first draft "
        "accepted " + "; ".join(parts)
    )


if __name__ == "__main__":
    main()
