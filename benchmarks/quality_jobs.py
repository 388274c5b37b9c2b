"""The jobs of bench_quality.py's real-model mode that run in this project's venv (benchmarks/quality_real.py
plans and starts them; the peers' trainings run in their own venvs: bench_quality.worker_speculators,
specforge_side.py):

    python benchmarks/quality_real.py ours  <train_ours_<seed>.json>   ours, 05's recipe, one seed
    python benchmarks/quality_real.py refs  <eval.json>                 eval prompts and their greedy paths
    python benchmarks/quality_real.py eval  <eval_<side>_<seed>.json>   tau of one training's kept drafters
    python benchmarks/quality_real.py serve <serve_<side>_<seed>.json>  served tau of its final drafter (--vllm)
    python benchmarks/quality_real.py report <work dir>                 the table of the seeds done so far

Each writes its result file last (the job's ``done`` file), so a rerun skips what finished.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from eagle_lib.decoding import specdec

ROOT = Path(__file__).resolve().parent.parent


def _plan(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# --- ours -----------------------------------------------------------------------------------------------
def job_ours(spec_path: str) -> None:
    """Ours for one seed: 05's recipe by 05's loop (`trainer.fit`) on the kept hidden states (07's reader),
    the drafter saved at step 0 and at every mark."""
    from quality_real import kept_sequences, step_sequences
    from safetensors.torch import load_file

    from eagle_lib import params
    from eagle_lib.data import batches
    from eagle_lib.drafter import optim, recipe, retrain, trainer, ttt
    from eagle_lib.drafter.model import save_state

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    plan, seed, out = _plan(spec["plan"]), spec["seed"], Path(spec["out"])
    p, shared = recipe.Params(**plan["bench_params"]), params.SharedParams(**plan["shared"])
    tr = retrain.Trainer(p, shared, 1, torch.device("cpu"))
    seqs = kept_sequences(tr, Path(plan["run_dir"]))[0]
    steps = plan["steps"]
    if [[k for *_, k in s] for s in step_sequences(seqs, tr.p, seed, steps)] != spec["keys"]:
        sys.exit("ours: the micro-batches differ from the ones planned for the peers")
    vmap = load_file(str(Path(spec["plan"]).parent / "vocab_map.safetensors"))
    p = tr.p
    drafter = recipe.new_drafter(tr.config, vmap["d2t"], vmap["t2d"], p, seed, tr.embed, tr.lm_head, tr.layer)
    recipe.frozen_in_bf16(drafter, tr.autocast)
    drafter = drafter.to(tr.device)
    stream = batches.BatchStream(seqs, p.pack_len, p.rows_per_batch, seed)
    model = ttt.TTT(
        drafter, tr.k, tr.decay, tr.attention, p.ttt_input, p.target_temperature, p.loss, p.loss_chunk,
        p.checkpoint_steps, terms=recipe.objective(p, tr.shared), positions=p.loss_positions,
    )  # fmt: skip
    opts = optim.for_recipe(model.named_parameters(), p)
    scheds = recipe.schedules(opts, p, steps, p.warmup_steps)
    save_state(drafter.state_dict(), drafter.config, out / "step_0")
    keep = set(plan["marks"])

    def snapshot(row: dict, _history: list) -> None:  # after the step's update, outside its timing
        if row["step"] in keep:
            save_state(drafter.state_dict(), drafter.config, out / f"step_{row['step']}")

    hist = trainer.fit("bench_quality", p, model, opts, scheds, tr.source, stream, tr.device, tr.k, tr.decay,
                       steps, "bench", drafter.config, out / "fit", meter=snapshot, log_every=0)  # fmt: skip
    shutil.rmtree(out / "fit" / "checkpoints", ignore_errors=True)
    tr.source.close()
    res = {"train_s": sum(r["seconds"] for r in hist), "final_loss": hist[-1]["loss"],
           "losses": [r["loss"] for r in hist], "hidden": tr.source.summary()}  # fmt: skip
    (out / "result.json").write_text(json.dumps(res))


# --- prompts and greedy paths -----------------------------------------------------------------------------
class Recorder:
    """A proposer that drafts nothing and keeps the target's aux features of every position it is shown."""

    name, needs_features, q = "record", True, None

    def __init__(self):
        self.feats: list[torch.Tensor] = []

    def start(self, seq, feats) -> None:
        self.feats = [feats]

    def propose(self, k: int) -> list[int]:
        return []

    def advance(self, new, feats) -> None:
        self.feats.append(feats)


class GreedyReplay:
    """`specdec.TargetRunner` at T=0 from one recorded greedy path (``seq`` = prompt + the target's greedy
    output, ``feats`` (len, 3H) its aux features): the verify of a block returns the greedy path's next tokens
    (one-hot rows: greedy verification reads only their argmax) and features. Rows past a block's first wrong
    draft are never read (the step rejects there), so every step is the real one's."""

    def __init__(self, seq: list[int], feats: torch.Tensor, vocab: int):
        self.seq, self.feats, self.vocab = seq, feats, vocab
        self.n, self.cache = 0, None

    def _onehot(self, ids: list[int]) -> torch.Tensor:
        x = torch.zeros(len(ids), self.vocab)
        x[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
        return x

    def prefill(self, prompt_ids: list[int]):
        if self.seq[: len(prompt_ids)] != list(prompt_ids):
            raise ValueError("GreedyReplay: another prompt than the recorded one")
        self.n = len(prompt_ids)
        return self._onehot([self.seq[self.n]])[0], self.feats[: self.n]

    def verify(self, block: list[int]):
        c, m = self.n, len(block)
        if block[0] != self.seq[c] or c + m > len(self.feats) or c + m + 1 > len(self.seq):
            raise ValueError(
                f"GreedyReplay: block at {c} off the recorded path (or past its {len(self.feats)})"
            )
        self.n = c + m
        return self._onehot(self.seq[c + 1 : c + m + 1]), self.feats[c : c + m]

    def keep(self, n: int) -> None:
        self.n = n


def _eval_prompts(cfg: dict, tok, target, eos):
    """06's prompts, each with its group (an eval set's name, later turns with their set; held-out: heldout):
    (T=0 prompts, T=1 prompts)."""
    import yaml

    from eagle_lib import acceptance, models  # noqa: F401
    from eagle_lib.params import SharedParams

    plan = cfg["plan"]
    shared = SharedParams(**plan["shared"])
    raw = yaml.safe_load((ROOT / plan["params"]).read_text())["stages"]["06_eval_acceptance"]
    p06 = acceptance.Params(**raw).served(shared)
    held, _ = acceptance.heldout_prompts(Path(plan["run_dir"]), shared.heldout_percent, p06)
    sets, _, multi = acceptance.eval_set_prompts(p06, tok)
    later = acceptance.later_turn_prompts(multi, tok, target, p06, eos)[0] if multi else {}
    names = [es.name for es in p06.eval_sets]
    out0, out1 = [], []
    for label, ps in {**sets, **later, **held}.items():
        group = next((n for n in names if label == n or label.startswith(f"{n}_turn")), "heldout")
        rows = [
            {"id": f"{label}/{q.id}", "dataset": label, "group": group, "prompt_ids": q.prompt_ids}
            for q in ps
        ]
        out0 += rows[: cfg["prompts"] or None]
        out1 += rows[: cfg["sampled_prompts"] or p06.sampled_max_prompts or None]
    return out0, out1, p06


def job_refs(path: str) -> None:
    """The eval prompts (06's) and, for each T=0 prompt, the target's greedy path with its aux features."""
    from eagle_lib import models
    from eagle_lib.params import SharedParams

    torch.set_num_threads(1)
    cfg = _plan(path)
    plan = cfg["plan"]
    shared = SharedParams(**plan["shared"])
    target, tok = models.load_target(shared, device="cpu"), models.load_tokenizer(shared)
    eos = models.stop_ids(tok, target, shared)
    t0 = time.perf_counter()
    p0, p1, p06 = _eval_prompts(cfg, tok, target, eos)
    eos = list(p06.stop_token_ids) or eos
    new_tokens = cfg["new_tokens"] or p06.eval_max_new_tokens
    runner, k, paths = specdec.TargetRunner(target, plan["aux_layers"]), plan["k"], {}
    for pr in p0:  # past the stop token and k + 2 further: room for every verify block
        rec = Recorder()
        g = specdec.speculative_generate(runner, rec, pr["prompt_ids"], new_tokens + k + 2, k, [])
        paths[pr["id"]] = {"seq": pr["prompt_ids"] + g.output_ids, "feats": torch.cat(rec.feats).float()}
    runner.cache = None
    out = {"t0": p0, "t1": p1, "paths": paths, "eos": eos, "new_tokens": new_tokens, "k": k,
           "top_p": cfg["top_p"] or p06.top_p, "draft_sampling": cfg["draft_sampling"] or p06.draft_sampling,
           "seconds": time.perf_counter() - t0}  # fmt: skip
    torch.save(out, Path(cfg["work"]) / "refs.tmp")
    (Path(cfg["work"]) / "refs.tmp").replace(Path(cfg["work"]) / "refs.pt")


# --- evaluation -----------------------------------------------------------------------------------------
def _drafter(task: dict, embed, aux: list[int]):
    from eagle_lib.drafter import export
    from eagle_lib.drafter.model import load_drafter

    if task["side"] == "ours":
        return load_drafter(task["dir"]).eval()
    d = export.load_export(task["dir"], embed, aux)
    if d.config.aux_layers != aux:
        raise ValueError(
            f"{task['dir']}: saved config names aux layers {d.config.aux_layers}, trained on {aux}"
        )
    return d


def greedy_sums(drafter, refs: dict, vocab: int, real=None) -> dict:
    """T=0 per prompt: num = sum(accepted + 1), den = verify steps, and the accepted list; `real` (a
    TargetRunner) decodes with the target itself instead of the recorded paths."""
    out = {}
    for pr in refs["t0"]:
        path = refs["paths"][pr["id"]]
        runner = real or GreedyReplay(path["seq"], path["feats"], vocab)
        g = specdec.speculative_generate(runner, specdec.EagleProposer(drafter), pr["prompt_ids"],
                                         refs["new_tokens"], refs["k"], refs["eos"])  # fmt: skip
        out[pr["id"]] = {
            "num": sum(a + 1 for a in g.accepted),
            "den": len(g.accepted),
            "accepted": g.accepted,
        }
    return out


def job_eval(path: str) -> None:
    """Tau of a shard's drafters: T=0 on the recorded greedy paths; T=1 (final drafters) by the real decoder
    (`heldout_tau.Decoder`, the same sampling seeds for every side). The first shard also decodes one drafter
    with the target at T=0 on a few prompts, to check the replay against the real decoder."""
    from eagle_lib import models
    from eagle_lib.data.evalsets import Prompt
    from eagle_lib.params import SharedParams
    from eagle_lib.serving import heldout_tau

    torch.set_num_threads(1)
    sh = _plan(path)
    work = Path(path).parent
    cfg = _plan(work / "eval.json")
    plan = cfg["plan"]
    refs = torch.load(work / "refs.pt", weights_only=False)
    target = models.load_target(SharedParams(**plan["shared"]), device="cpu")
    embed, vocab = target.get_input_embeddings().weight.detach(), target.config.vocab_size
    prompts1 = [Prompt(p["id"], p["dataset"], p["prompt_ids"]) for p in refs["t1"]]
    decoder = heldout_tau.Decoder(target, prompts1, refs["new_tokens"], refs["k"], refs["eos"])
    for task in sh["tasks"]:
        out = Path(task["dir"]) / "tau.json"
        if out.exists():
            continue
        t0 = time.perf_counter()
        drafter = _drafter(task, embed, plan["aux_layers"])
        res = {"task": task, "t0": greedy_sums(drafter, refs, vocab), "t0_s": time.perf_counter() - t0}
        if task["sampled"]:
            t1 = time.perf_counter()
            num, den = decoder.decode(
                drafter, cfg["temperature"], refs["top_p"], refs["draft_sampling"], cfg["reps"]
            )
            res["t1"] = {
                p.id: {"num": float(n), "den": float(d)} for p, n, d in zip(prompts1, num, den, strict=True)
            }
            res["t1_s"] = time.perf_counter() - t1
        out.write_text(json.dumps(res))
        print(
            f"{task['side']} seed {task['seed']} step {task['step']}: {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    if sh.get("check"):
        _check(work, sh["tasks"], refs, target, embed, vocab, plan)
    (Path(path).with_suffix(".done")).write_text("ok")


def _check(work: Path, tasks, refs, target, embed, vocab, plan, per_group: int = 2) -> None:
    """Replay vs the real decoder (the target's own KV-cache verify) on the first prompts of each group."""
    check = work / "check.json"
    if check.exists():
        return
    task = next((t for t in tasks if t["sampled"]), tasks[0])
    drafter = _drafter(task, embed, plan["aux_layers"])
    picked = []
    for g in dict.fromkeys(p["group"] for p in refs["t0"]):
        picked += [p for p in refs["t0"] if p["group"] == g][:per_group]
    sub = {**refs, "t0": picked}
    replay = greedy_sums(drafter, sub, vocab)
    real = greedy_sums(drafter, sub, vocab, specdec.TargetRunner(target, plan["aux_layers"]))
    same = sum(replay[i]["accepted"] == real[i]["accepted"] for i in replay)
    tau = {n: sum(v["num"] for v in r.values()) / sum(v["den"] for v in r.values()) for n, r in
           (("replay", replay), ("real", real))}  # fmt: skip
    check.write_text(json.dumps({"task": task, "prompts": len(picked), "same": same, "tau": tau}))


# --- served by vLLM ---------------------------------------------------------------------------------------
def served_export(task: dict, work: Path, plan: dict, shared) -> Path:
    """The directory vLLM loads for a side's final drafter: speculators' own saved checkpoint; ours and
    SpecForge's weights written in the speculators format by our exporter (SpecForge saves no vLLM format; its
    reader takes the target's embedding, read alone from the safetensors)."""
    from eagle_lib import models
    from eagle_lib.drafter import export
    from eagle_lib.hidden_states.hidden import load_target_embedding

    if task["side"] == "speculators":
        return Path(task["dir"])
    tgt = models.resolve(shared.target)
    embed = load_target_embedding(tgt, models.hub_kwargs(shared)["revision"])
    arch = models.load_config(tgt).architectures or ["LlamaForCausalLM"]
    out = work / task["side"] / f"seed{task['seed']}" / "served_export"
    return export.export_speculators(_drafter(task, embed, plan["aux_layers"]), out, tgt, arch, plan["k"])


def job_serve(path: str) -> None:
    """Served tau of one side's final drafter: a vLLM CPU server (one thread) on the target with it, the T=0
    prompts greedy (each output checked against the target's greedy path in refs.pt) and the T=1 prompts at
    refs' top_p and draft sampling, one request seed; per prompt group, as vLLM's /metrics counts them."""
    import os

    from eagle_lib import models
    from eagle_lib.data.evalsets import Prompt
    from eagle_lib.engines.vllm_server import start_vllm
    from eagle_lib.params import SharedParams
    from eagle_lib.serving import commands, online

    os.environ.setdefault("EAGLE_MAX_THREADS", "1")  # the server's threads: this job's one core
    task = _plan(path)
    work = Path(path).parent
    plan = _plan(work / "eval.json")["plan"]
    refs = torch.load(work / "refs.pt", weights_only=False)
    shared = SharedParams(**plan["shared"])
    export_dir = served_export(task, work, plan, shared)
    t0 = time.perf_counter()

    def groups(rows: list[dict]) -> dict[str, list[Prompt]]:
        out: dict[str, list[Prompt]] = {}
        for r in rows:
            out.setdefault(r["group"], []).append(Prompt(r["id"], r["dataset"], r["prompt_ids"]))
        return out

    spec = commands.vllm_spec(str(export_dir), refs["k"], refs["draft_sampling"])
    longest = max(len(r["prompt_ids"]) for r in refs["t0"] + refs["t1"])
    with start_vllm(models.resolve(shared.target), extra_args=["--speculative-config", json.dumps(spec)],
                    tokenizer=models.resolve(shared.tokenizer_path), log_dir=work / f"vllm_{task['side']}_{task['seed']}",
                    max_model_len=longest + refs["new_tokens"] + 2 * refs["k"] + 8) as srv:  # fmt: skip
        greedy = online.online_vllm(srv.base_url, srv.model, groups(refs["t0"]), refs["new_tokens"], refs["k"],
                                    stop_ids=refs["eos"])  # fmt: skip
        s = online.Sampling(temperature=1.0, top_p=refs["top_p"], top_k=0)
        sampled = online.online_vllm(srv.base_url, srv.model, groups(refs["t1"]), refs["new_tokens"], refs["k"],
                                     sampling=s, seed=1, stop_ids=refs["eos"])  # fmt: skip
    same, n = 0, 0
    for r in refs["t0"]:
        want = refs["paths"][r["id"]]["seq"][len(r["prompt_ids"]) :][: refs["new_tokens"]]
        got = next(g["outputs"][r["id"]] for g in greedy.values() if r["id"] in g["outputs"])
        m = min(len(got), len(want))  # a stop token kept by one side and not the other
        same, n = same + (got[:m] == want[:m] and m > 0), n + 1
    res = {"task": task, "export": str(export_dir), "same": same, "n": n, "seconds": time.perf_counter() - t0}
    for key, raw in (("t0", greedy), ("t1", sampled)):
        res[key] = {g: {k: v[k] for k in ("accepted", "drafts", "tau")} for g, v in raw.items()}
    out = work / task["side"] / f"seed{task['seed']}" / "served.json"
    out.write_text(json.dumps(res))
    print(f"{task['side']} seed {task['seed']} served: {same}/{n} greedy outputs = target's, "
          f"{res['seconds']:.0f} s", flush=True)  # fmt: skip


def job_report(work: str) -> None:
    """The table from whatever seeds are complete in a work dir (a run stopped early)."""
    from quality_report import report

    print(report(Path(work), _plan(Path(work) / "plan.json"), None))


def main(argv: list[str]) -> None:
    jobs = {"ours": job_ours, "refs": job_refs, "eval": job_eval, "serve": job_serve, "report": job_report}
    if len(argv) != 2 or argv[0] not in jobs:
        sys.exit(f"usage: quality_real.py {{{','.join(jobs)}}} SPEC_JSON")
    jobs[argv[0]](argv[1])
