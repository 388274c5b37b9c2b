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
decoded cycles start where the drafter is weakest: positions of low acceptance come in stretches, and a cycle there
yields one token, so they fill the cycles. The teacher-forced first-draft acceptance is also split by the target's
confidence at the drafted position, over rows whose input was a sampled (non-argmax) token, and re-weighted to the
residual a token after a rejection is drawn from (`by_position`).
With ``--decode-reps R`` it also decodes 06's held-out prompts (``--per-dataset``, ``--new-tokens``, R sampling seeds
a prompt, probabilistic drafts, `eagle_lib.decoding.specdec` as 06 decodes) and splits the first draft's acceptance
by how the cycle before ended: all drafts accepted (the next token drawn from the target's own distribution) or a
rejection (the next token drawn from the residual max(0, p - q)), the latter by the draft that was rejected.

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
        print(by_position(tr, drafter, held, t))
        if a.decode_reps:
            print(after_what(run, tr, drafter, t, a))


CONFIDENCE = (0.2, 0.4, 0.6, 0.8)  # bins of the target's top-1 probability (served) at the drafted position


def by_position(tr, drafter, held, t: float) -> str:
    """Teacher-forced acceptance of the first draft drawn from the drafter, as decoding computes it: each
    held-out sequence run through the drafter's own incremental forward (one row per target position, as
    `specdec.EagleProposer` prefills) and alpha_t = sum min(p, q) between the target's served distribution at the
    drafted position (`sampling.warp`: T, top_p over the whole vocab) and softmax(draft logits / T) on the draft
    ids, at every label (no draft-vocab filter, as decoding). Split by the target's top-1 probability there (with
    that probability: the acceptance of the target's own argmax as a draft; and the draft's own top-1 probability,
    which says whether it is too sharp or too flat there), over rows whose input token was not
    the target's argmax (a sampled token), and re-weighted to the residual: a row whose input x was drawn from p
    weighs (p(x) - q(x))+ / p(x), q the drafter's distribution for x one row before, so the weighted mean is the
    acceptance right after a rejection at a single position, were rejections spread over positions as tokens are."""
    import torch

    from eagle_lib.data import batches
    from eagle_lib.decoding.sampling import warp

    top_p = tr.shared.serve_top_p
    ids_map = drafter.draft_ids()
    n_bins = len(CONFIDENCE) + 1
    bins = torch.zeros(4, n_bins, dtype=torch.float64)  # labels, sum alpha, sum top-1 of p, of q
    alls, surprise, resid = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    with torch.no_grad():
        for j, s in enumerate(held):
            n = len(s.input_ids)
            aux, tl = tr.source(batches.make_batch(held, [[j]]))
            x = torch.tensor(s.input_ids)
            _, logits = drafter(x[None, 1:], drafter.project(aux[:, : n - 1].to(drafter.fc.weight.dtype)),
                                torch.arange(n - 1)[None], drafter.new_cache())  # fmt: skip
            q = torch.zeros(n - 1, tl.shape[-1], dtype=torch.float64)
            q[:, ids_map] = (logits[0].double() / t).softmax(-1)  # row r drafts x[r+2]
            p = warp(tl[0, :n].detach().cpu(), t, 0, top_p)  # position r predicts x[r+1]
            ok = torch.zeros(n - 1, dtype=torch.bool)
            ok[: n - 2] = torch.tensor(s.loss_mask[2:]).bool()
            for r in ok.nonzero().flatten().tolist():
                alpha = float(torch.minimum(p[r + 1], q[r]).sum())
                top1 = float(p[r + 1].max())
                b = sum(top1 >= e for e in CONFIDENCE)
                bins[:, b] += torch.tensor([1.0, alpha, top1, float(q[r].max())], dtype=torch.float64)
                alls[0] += alpha
                alls[1] += 1
                xin = s.input_ids[r + 1]
                if xin != int(p[r].argmax()):
                    surprise[0] += alpha
                    surprise[1] += 1
                if r >= 1 and ok[r - 1] and p[r, xin] > 0:
                    w = max(0.0, 1.0 - float(q[r - 1, xin] / p[r, xin]))
                    resid[0] += w * alpha
                    resid[1] += w
    lows = (0.0, *CONFIDENCE)
    highs = (*CONFIDENCE, 1.0)
    out = [
        f"  teacher-forced first-draft acceptance, drafter forward as decoding: all {alls[0] / alls[1]:.3f} "
        f"({alls[1]:.0f} labels); rows whose input was sampled, not the argmax, {surprise[0] / max(surprise[1], 1):.3f} "
        f"({surprise[1]:.0f}); re-weighted to the residual after a rejection {resid[0] / max(resid[1], 1e-9):.3f}",
        "  by the target's top-1 probability at the drafted position: share of labels, acceptance, the target's own "
        "argmax as a draft (= its top-1 probability), the draft's top-1 probability:",
    ]  # fmt: skip
    for lo, hi, (nb, sa, st, sq) in zip(lows, highs, bins.T.tolist(), strict=True):
        if nb:
            out.append(
                f"    [{lo:.1f}, {hi:.1f}): {nb / alls[1]:.3f}  {sa / nb:.3f}  {st / nb:.3f}  {sq / nb:.3f}"
            )
    return "\n".join(out)


def after_what(run: Path, tr, drafter, t: float, a) -> str:
    """The first draft's acceptance by how the cycle before ended, decoding 06's held-out prompts at T=t."""
    import torch

    from eagle_lib import models
    from eagle_lib.decoding import specdec
    from eagle_lib.serving import heldout_tau

    torch.set_num_threads(1)
    target = models.load_target(tr.shared, device="cpu")
    eos = models.stop_ids(models.load_tokenizer(tr.shared), target)
    prompts, _ = heldout_tau.heldout_prompts(run, tr.shared.heldout_percent, a.per_dataset, 768)
    decoder = heldout_tau.Decoder(target, prompts, a.new_tokens, tr.k, eos)  # 06's decode, its sampling seeds
    num, den = decoder.decode(drafter, t, tr.shared.serve_top_p, "probabilistic", a.decode_reps)
    tokens, steps = num.sum(), den.sum()
    gens = decoder.generations
    counts = specdec.first_draft_by_cycle_start((g.matched, g.drafted) for g in gens)
    parts = [f"{how} {n / c:.3f} of {c}" for how, (n, c) in counts.items() if c]
    # after a rejection, by the draft the cycle before was rejected at: a run of rejections at the first draft
    # (one token a cycle) is a stretch where the drafter is weak, whatever token started it
    at = {}
    for g in gens:
        for i in range(1, len(g.matched)):
            if g.drafted[i] and g.matched[i - 1] < g.drafted[i - 1]:
                c = at.setdefault(g.matched[i - 1], [0, 0])
                c[0] += g.matched[i] >= 1
                c[1] += 1
    split = "; ".join(f"at draft {j + 1}: {h / c:.3f} of {c}" for j, (h, c) in sorted(at.items()))
    return (
        f"  decoded ({len(prompts)} prompts x {a.decode_reps} seeds, tau {tokens / steps:.3f}): first draft "
        "accepted "
        + "; ".join(parts)
        + f"\n  after a rejection, by the draft the cycle before rejected: {split}"
    )


if __name__ == "__main__":
    main()
