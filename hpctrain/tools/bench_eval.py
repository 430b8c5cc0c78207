"""`hpctrain bench eval`: downstream-evaluation throughput, hpctrain's scorer against lm-eval's own `--model hf` on
the exported checkpoint — the same model, task, requests and batch size, in one process, runs alternating.

A model (model=tiny by default) trained two steps on the demo shards and exported; a local multiple-choice task of
--docs documents (four choices each: 4 requests a document) and a perplexity task; each side scores both with
lm-eval's `simple_evaluate`, and the table gives requests/s and the ratio. Whatever is measured is reported.
"""

from __future__ import annotations

import glob
import json
import os
import random
import statistics
import tempfile
import time

import torch

from hpctrain.core.argparser import Parser, at_least
from hpctrain.core.host import usable_cpus

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "they", "which", "this", "have", "are", "were", "be", "had", "not", "one", "all", "but", "when", "there", "can", "more", "other", "new", "first", "time", "year", "two", "also", "after", "people", "into", "only", "most"]


def _tasks(out: str, docs: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with open(os.path.join(out, "mc.jsonl"), "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"q": words(10, 40), "c": [words(2, 8) for _ in range(4)], "a": rng.randrange(4)}) + "\n")
    with open(os.path.join(out, "ppl.jsonl"), "w") as f:
        for _ in range(max(1, docs // 10)):
            f.write(json.dumps({"text": words(100, 400)}) + "\n")
    head = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {}\n"
    with open(os.path.join(out, "bench_mc.yaml"), "w") as f:
        f.write("task: bench_mc\n" + head.format(os.path.join(out, "mc.jsonl")) +
                "output_type: multiple_choice\ndoc_to_text: \"{{q}}\"\ndoc_to_choice: \"{{c}}\"\n"
                "doc_to_target: \"{{a}}\"\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(out, "bench_ppl.yaml"), "w") as f:
        f.write("task: bench_ppl\n" + head.format(os.path.join(out, "ppl.jsonl")) +
                "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                "metric_list:\n  - metric: word_perplexity\n")


def _train(work: str, model: str, threads: int):
    """A run of two steps, exported: (its directory, its config)."""
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    run = os.path.join(work, "run")
    cfg = compose([f"model={model}", "data=demo", "train.max_steps=2", "train.eval_every=0", "train.ckpt_every=0",
                   "logging.trackers=[]", "train.progress=false", "train.export_hf_at_end=true",
                   f"cluster.num_threads={threads}", f"run_dir={run}"])
    train(cfg, run)
    return run, cfg


def _hpctrain_lm(run: str, mcfg, pcfg, data_dir: str, batch: int):
    """hpctrain's LM over the run's final checkpoint (`mcfg`, `pcfg`: its model and precision groups), one process
    (what the loop's scorer does at dp=1)."""
    from hpctrain.evaluation.harness import HpctrainLM
    from hpctrain.models import build_model
    from hpctrain.storage import checkpoint
    from hpctrain.training.downstream import Scorer, tokenizer_of
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    model = build_model(mcfg)
    checkpoint.load_model(checkpoint.latest(run), model)
    cpu = torch.device("cpu")
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), setup_precision(pcfg, cpu), 0.0, cpu)
    return HpctrainLM(tokenizer_of(data_dir), Scorer(step, None, batch, mcfg.max_seq_len), mcfg.max_seq_len)


def _timed(lm, tasks_dir: str) -> tuple[float, int]:
    """(seconds, requests) of lm-eval scoring both tasks with `lm`."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    t0 = time.perf_counter()
    out = evaluator.simple_evaluate(model=lm, tasks=["bench_mc", "bench_ppl"], task_manager=manager,
                                    bootstrap_iters=0, log_samples=True)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(s["resps"]) for samples in out["samples"].values() for s in samples)


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="hpctrain bench eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--docs", type=at_least(1), default=200, help="multiple-choice documents (4 requests each)")
    p.add_argument("--batch", type=at_least(1), default=16, help="requests per forward, both sides")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(1), default=usable_cpus())
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-eval-") as work:
        _tasks(work, a.docs)
        run, cfg = _train(work, a.model, a.threads)
        (export,) = glob.glob(os.path.join(run, "hf", "step-*"))
        ours = _hpctrain_lm(run, cfg.model, cfg.precision, os.path.expanduser(cfg.data.path), a.batch)
        theirs = HFLM(pretrained=export, dtype="float32", batch_size=a.batch, max_length=ours.max_length,
                      device="cpu")
        times = {"hpctrain": [], "lm-eval hf": []}
        requests = 0
        for rep in range(a.repeats):
            for name, lm in ((("hpctrain", ours), ("lm-eval hf", theirs)) if rep % 2 == 0 else
                             (("lm-eval hf", theirs), ("hpctrain", ours))):
                seconds, requests = _timed(lm, work)
                times[name].append(seconds)
                print(f"  [{rep + 1}/{a.repeats}] {name:10} {requests / seconds:8.1f} requests/s ({seconds:.1f} s)",
                      flush=True)
    rates = {name: requests / statistics.median(t) for name, t in times.items()}
    print(f"\n{'side':10} | {'requests/s':>10} | vs lm-eval hf\n" + "-" * 40)
    for name, rate in rates.items():
        print(f"{name:10} | {rate:10.1f} | {rate / rates['lm-eval hf']:.2f}×")
    print(f"model={a.model}, {requests} requests (multiple choice + rolling windows), batch {a.batch}, "
          f"{a.threads} threads, median of {a.repeats}")
    doc = {"rates": rates, "times_s": times, "requests": requests, "settings": vars(a)}
    if a.json:
        from hpctrain.core.files import write_json

        write_json(a.json, doc)
    return doc


if __name__ == "__main__":
    main()
