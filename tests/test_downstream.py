"""Downstream evaluation (the eval group): lm-evaluation-harness tasks scored by the run's model in its layout, against
lm-eval's own `--model hf` on the exported checkpoint — on local tasks made by the test (offline)."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys

import pytest

from hpctrain.core.errors import ConfigError

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "red", "blue", "green", "house", "tree",
         "river", "code", "data", "model", "train"]
RUN = ("train.global_batch=8", "train.micro_batch=2", "train.max_steps=4", "train.eval_every=0", "train.ckpt_every=0",
       "logging.trackers=[tensorboard]", "cluster.num_threads=1", "optim.decay_steps=12", "model.tie_embeddings=false",
       "train.export_hf_at_end=true", "eval.every=2", "eval.log_samples=true",
       # barely trained from a wide init: greedy generation varies from document to document
       "model.init_std=0.2", "optim.lr=1e-5")


def _task(name: str, data: str, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


def _metrics(*metrics: tuple[str, str, bool]) -> str:
    """metric_list entries with their aggregation and direction (without them lm-eval warns of its defaults)."""
    return "".join(f"  - metric: {m}\n    aggregation: {agg}\n    higher_is_better: {str(up).lower()}\n"
                   for m, agg, up in metrics)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory) -> str:
    """A multiple-choice task (acc, acc_norm: loglikelihood requests), a perplexity task (loglikelihood_rolling:
    documents longer than the model's 64 tokens, so several windows each) and a generative one, as lm-eval YAML
    reading local JSON lines — what an offline cluster does."""
    out = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    mc = [{"question": words(3, 9), "choices": [words(1, 4) for _ in range(4)], "answer": rng.randrange(4)}
          for _ in range(10)]
    (out / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (out / "ppl.jsonl").write_text("".join(json.dumps({"text": words(5, 90)}) + "\n" for _ in range(5)))
    (out / "hpc_mc.yaml").write_text(_task("hpc_mc", out / "mc.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n" + _metrics(("acc", "mean", True), ("acc_norm", "mean", True)))))
    (out / "hpc_ppl.yaml").write_text(_task("hpc_ppl", out / "ppl.jsonl", (
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n" + _metrics(("word_perplexity", "weighted_perplexity", False),
                                  ("byte_perplexity", "weighted_perplexity", False),
                                  ("bits_per_byte", "bits_per_byte", False)))))
    (out / "hpc_gen.yaml").write_text(_task("hpc_gen", out / "mc.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")))
    (out / "hpc_sample.yaml").write_text(_task("hpc_sample", out / "mc.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  do_sample: true\n  temperature: 0.7\nmetric_list:\n  - metric: exact_match\n")))
    # lm-eval samples where a temperature is set, and gives 256 new tokens where max_gen_toks is not
    (out / "hpc_warm.yaml").write_text(_task("hpc_warm", out / "mc.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  temperature: 0.7\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n")))
    (out / "hpc_long.yaml").write_text(_task("hpc_long", out / "mc.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\nmetric_list:\n  - metric: exact_match\n")))
    (out / "hpc_nodata.yaml").write_text(_task("hpc_nodata", out / "missing.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")))
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    return str(out)


def _reference(export: str, tasks_dir: str, tasks: list[str], cli: bool, out) -> tuple[dict, dict]:
    """lm-eval's --model hf on the export: ({task: {metric: value}}, {task: [each document's answers]})."""
    model_args = f"pretrained={export},dtype=float32,max_length=64"
    if cli:  # the command a user runs: `lm_eval ...`'s entry point, in a fork of this process (its imports done)
        from helpers import run_forked

        ran = run_forked(_lm_eval_cli, ["--model", "hf", "--model_args", model_args, "--tasks", ",".join(tasks),
                                        "--include_path", tasks_dir, "--device", "cpu", "--output_path", str(out),
                                        "--log_samples"], cwd=os.path.dirname(str(out)),
                         env={"HF_DATASETS_OFFLINE": "1"}, timeout=300)
        assert ran.code == 0, ran.err
        (results_file,) = glob.glob(f"{out}/*/results_*.json")
        results = json.loads(open_text(results_file))["results"]
        samples = {t: _lines(glob.glob(f"{out}/*/samples_{t}_*.jsonl")[0]) for t in tasks}
    else:  # the same code in this process (lm-eval's CLI is ~10 s of imports)
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager

        got = evaluator.simple_evaluate(model="hf", model_args=model_args, tasks=tasks,
                                        task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                        log_samples=True, bootstrap_iters=0, device="cpu")
        results, samples = got["results"], got["samples"]
    return results, {t: sorted(s, key=lambda s: s["doc_id"]) for t, s in samples.items()}


def open_text(path) -> str:
    with open(path) as f:
        return f.read()


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in open_text(path).splitlines()]


def _lm_eval_cli(argv: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0


def _answers(sample: dict) -> list[float]:
    """Each request's log-likelihood of a logged sample (lm-eval writes them as strings in its files)."""
    out = []
    for resp in sample["resps"]:
        first = resp[0]
        out.append(float(first[0] if isinstance(first, (list, tuple)) else first))
    return out


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [[], ["parallel=fsdp", "parallel.dp=2"], ["parallel=tp2"], ["parallel=pp2"]],
                         ids=["single", "fsdp", "tp2", "pp2"])
def test_in_loop_scores_equal_lm_eval_on_the_export(make_cfg, local_tasks, tmp_path, layout):
    """Trained four steps, scored at steps 2 and 4 in the run's layout: the step-4 scores and every request's
    log-likelihood (to 1e-4, or 1e-6 relative) and every greedy generation equal lm-eval's --model hf on the exported
    step-4 checkpoint; logged as eval/<task>/<metric> in metrics.jsonl and TensorBoard."""
    from hpctrain.core.files import read_metrics
    from hpctrain.training.run import train

    run = tmp_path / "run"
    # an alert rule watching a score (one process): acc is below 2 at every evaluation
    watch = [] if layout else ["+monitor.rules.mc={metric:eval/hpc_mc/acc,threshold:2,when:below,for_s:0}"]
    tasks = ["hpc_mc", "hpc_ppl", "hpc_gen"]
    cfg = make_cfg(*RUN, f"eval.include_path={local_tasks}", *layout, *watch, f"eval.tasks=[{','.join(tasks)}]")
    assert train(cfg, str(run))["status"] == "completed"
    logged = {m["step"]: m for m in read_metrics(str(run)) if "eval/hpc_mc/acc" in m}
    assert sorted(logged) == [2, 4], logged
    (export,) = glob.glob(str(run / "hf" / "step-*"))
    results, samples = _reference(export, local_tasks, tasks, cli=not layout, out=tmp_path / "ref")
    for task, metrics in (("hpc_mc", ("acc", "acc_norm")), ("hpc_ppl", ("word_perplexity", "bits_per_byte"))):
        for metric in metrics:
            assert logged[4][f"eval/{task}/{metric}"] == pytest.approx(results[task][f"{metric},none"], rel=1e-5)
        ours = _lines(run / "eval_samples" / "step-4" / f"{task}.jsonl")
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in samples[task]]
        for mine, theirs in zip(ours, samples[task]):
            # 1e-4, or 1e-6 of a perplexity document's summed log-likelihood (~-1,200 over its windows)
            assert _answers(mine) == pytest.approx(_answers(theirs), abs=1e-4, rel=1e-6), (task, mine["doc_id"])
    if "hpc_gen" in tasks:  # greedy generation: the same text for every document (a pipeline's too)
        ours = _lines(run / "eval_samples" / "step-4" / "hpc_gen.jsonl")
        assert [s["resps"] for s in ours] == [s["resps"] for s in samples["hpc_gen"]]
        assert logged[4]["eval/hpc_gen/exact_match"] == results["hpc_gen"]["exact_match,none"]
    if not layout:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(run / "tb"))
        ea.Reload()
        assert [e.step for e in ea.Scalars("eval/hpc_mc/acc")] == [2, 4]
        alerts = _lines(run / "alerts.jsonl")
        assert [(a["event"], a["step"]) for a in alerts if a.get("rule") == "mc"] == [("firing", 2)], alerts


@pytest.mark.parametrize("overrides,words", [
    (["eval.tasks=[nope_task]"], ["eval.tasks: nope_task unknown to lm-eval", "eval.include_path"]),
    (["eval.tasks=[hpc_sample]"], ["hpc_sample sample their generations", "do_sample: false"]),
    (["eval.tasks=[hpc_nodata]"], ["lm-eval could not load them", "data files"]),
    (["eval.tasks=[hpc_warm]"], ["eval.tasks: hpc_warm asks for sampling", "no temperature"]),
    (["eval.tasks=[hpc_long]"], ["eval.tasks: hpc_long asks for 256 new tokens", "eval.max_length=64"]),
    (["eval.tasks=[hpc_mc]", "eval.num_fewshot=20"], ["eval.num_fewshot=20 but hpc_mc has 10 documents", "at most 9"]),
    (["eval.tasks=[hpc_mc]", "eval.num_fewshot=-1"], ["eval.num_fewshot=-1", "num_fewshot >= 0"]),
    (["eval.tasks=[hpc_mc]", "eval.max_length=-5"], ["eval.max_length=-5", "max_length >= 1"]),
    (["eval.tasks=[hpc_mc]", "eval.max_length=4096"], ["eval.max_length=4096 exceeds model.max_seq_len"]),
    (["eval.tasks=[hpc_mc]", "eval.batch_size=0"], ["eval.batch_size=0"]),
    (["eval.tasks=[hpc_mc]", "eval.mode=job", "train.ckpt_async=true"], ["eval.mode=job", "train.ckpt_async=false"]),
    (["eval.tasks=[hpc_mc]", "eval.mode=job", "eval.every=3", "train.ckpt_every=2"],
     ["eval.every=3", "multiple of train.ckpt_every=2"]),
])
def test_bad_eval_settings_are_one_line_before_anything_starts(make_cfg, local_tasks, overrides, words):
    from hpctrain.training.run import prepare

    with pytest.raises(ConfigError) as e:
        prepare(make_cfg(f"eval.include_path={local_tasks}", *overrides))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="eval.include_path=.* is not a directory"):
        prepare(make_cfg("eval.tasks=[hpc_mc]", f"eval.include_path={local_tasks}/nope"))


def test_a_task_file_that_does_not_parse_is_named(make_cfg, local_tasks, tmp_path):
    """lm-eval passes over a task YAML it cannot parse, so its task reads as unknown: the file is named instead."""
    from hpctrain.training.run import prepare

    (tmp_path / "hpc_broken.yaml").write_text(_task("hpc_broken", f"{local_tasks}/mc.jsonl",
                                                     "output_type: [multiple_choice\n"))
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg(f"eval.include_path={tmp_path}", "eval.tasks=[hpc_broken]"))
    assert f"eval.tasks: {tmp_path}/hpc_broken.yaml declares task hpc_broken but does not parse (" in str(e.value)
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.multiproc
def test_hpctrain_eval_scores_a_runs_checkpoints_in_another_layout_and_a_sweep(local_tasks, demo_data, tmp_path):
    """`hpctrain eval RUN_DIR checkpoint=all` in tp2 scores the run's step-2 and step-4 checkpoints as the run
    scored them in the loop (one process), appended to evals.jsonl; a sweep directory gives one row per run."""
    import shutil

    from helpers import cli_args, run_forked

    from hpctrain import cli
    from hpctrain.core.files import read_evals, read_metrics
    from hpctrain.tools import evaluate

    run = tmp_path / "sweep" / "0"
    tasks = ["eval.tasks=[hpc_mc,hpc_ppl]", f"eval.include_path={local_tasks}"]
    # (data.path relative to where the run starts: recorded absolute, so the tools read it from anywhere, below)
    trained = run_forked(cli.main, cli_args(run, os.path.relpath(demo_data, tmp_path), "train.max_steps=4",
                                            "train.ckpt_every=2", "eval.every=2", "model.tie_embeddings=false",
                                            "train.progress=false", *tasks), cwd=tmp_path)
    assert trained.code == 0, trained.err
    from omegaconf import OmegaConf

    assert OmegaConf.load(run / ".hydra" / "config.yaml").data.path == demo_data
    in_loop = {m["step"]: m for m in read_metrics(str(run)) if "eval/hpc_mc/acc" in m}
    ran = run_forked(evaluate.main, [str(run), "checkpoint=all", "parallel=tp2", *tasks], cwd=tmp_path)
    assert ran.code == 0, ran.err
    got = {r["step"]: r for r in read_evals(str(run))}
    assert sorted(got) == [2, 4] and "hpc_ppl/bits_per_byte" in ran.out, ran.out
    for step in (2, 4):
        for key in ("eval/hpc_mc/acc", "eval/hpc_mc/acc_norm", "eval/hpc_ppl/word_perplexity"):
            assert got[step][key] == pytest.approx(in_loop[step][key], rel=1e-5), (step, key)
    # once=true (a requeued eval job's): a checkpoint scored with the same key is not scored again; another context
    # length (or task directory) is another key, scored and printed (the record of this checkpoint and key)
    step4, scored = f"checkpoint={run}/checkpoints/step-0000004", len(read_evals(str(run)))
    ran = run_forked(evaluate.main, [str(run), step4, "once=true", *tasks], cwd=tmp_path)
    assert ran.code == 0 and "scored already" in ran.err and len(read_evals(str(run))) == scored, ran.err
    ran = run_forked(evaluate.main, [str(run), step4, "once=true", "eval.max_length=32", *tasks], cwd=tmp_path.parent)
    shorter = read_evals(str(run))[-1]
    assert ran.code == 0 and len(read_evals(str(run))) == scored + 1, ran.err
    assert "not a git repository" not in ran.err, ran.err  # (lm-eval's provenance is not collected: scores only)
    assert shorter["scored_with"]["max_length"] == 32 and shorter["scored_with"]["include_path"] == local_tasks
    assert f"{shorter['eval/hpc_ppl/word_perplexity']:.4f}" in ran.out, ran.out
    shutil.copytree(run, tmp_path / "sweep" / "1", ignore=shutil.ignore_patterns("evals.jsonl"))
    ran = run_forked(evaluate.main, [str(tmp_path / "sweep"), "eval.limit=4", *tasks], cwd=tmp_path)
    assert ran.code == 0 and [line.split()[0] for line in ran.out.splitlines()[1:]] == ["0", "1"], ran.out
    from hpctrain.launch.sweep import format_table, report

    shown = format_table(report(str(tmp_path / "sweep")))  # the sweep report: each run's latest scores
    assert "downstream (last eval)" in shown and "hpc_mc/acc " in shown, shown
    last = read_evals(str(run))[-1]  # (the sweep's eval.limit=4 scores)
    with open(run / "evals.jsonl", "a") as f:  # another task scored later at the latest step: both are shown
        f.write(json.dumps({"step": 4, "eval/hpc_gen/exact_match": 0.25}) + "\n")
    scores = report(str(tmp_path / "sweep"))[0]["eval_scores"]
    assert scores["hpc_gen/exact_match"] == 0.25 and scores["hpc_mc/acc"] == last["eval/hpc_mc/acc"], scores
    # refused before anything is scored: a checkpoint not the run's own step-N, one checkpoint for a whole sweep, a
    # sweep with a run that has no checkpoint (the other's evals.jsonl untouched), a checkpoint that cannot be loaded
    best, broken = run / "best", run / "checkpoints" / "step-0000009"
    shutil.copytree(run / "checkpoints" / "step-0000004", best)
    shutil.copytree(run / "checkpoints" / "step-0000004", broken)
    (shard,) = [p for p in broken.iterdir() if p.suffix == ".distcp"][:1]
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "sweep" / "2" / ".hydra").mkdir(parents=True)
    shutil.copy(run / ".hydra" / "config.yaml", tmp_path / "sweep" / "2" / ".hydra")
    before = (run / "evals.jsonl").read_text()
    for argv, words in (([str(run), "eval.tasks=[]"], "pass 'eval.tasks=[TASK,...]'"), ([str(run), "train.lr=1", *tasks], "train.lr="),
                        ([str(tmp_path / "nope"), *tasks], "is not a directory"),
                        ([str(run), f"checkpoint={best}", *tasks], f"checkpoint={best} is not one of {run}/checkpoints"),
                        ([str(tmp_path / "sweep"), f"checkpoint={run}/checkpoints/step-0000004", *tasks],
                         "with the 3 runs of"),
                        ([str(tmp_path / "sweep"), *tasks], f"no complete checkpoint in {tmp_path}/sweep/2/checkpoints"),
                        ([str(run), f"checkpoint={broken}", *tasks], "pass checkpoint=RUN_DIR/checkpoints/step-N")):
        ran = run_forked(evaluate.main, argv, cwd=tmp_path)
        assert ran.code == 2 and words in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err
    assert (run / "evals.jsonl").read_text() == before


def test_a_record_of_an_older_key_still_answers_once():
    """once=true: a record written before scored_with held include_path and max_length (an eval job requeued across
    the upgrade) is this key's when what it holds agrees; a value it holds that differs is another key."""
    from hpctrain.core.config import EvalConfig
    from hpctrain.training.checkpoint_eval import _key, _same_key

    key = _key(EvalConfig(tasks=["b", "a"], include_path="/t", max_length=32))
    assert _same_key({"tasks": ["a", "b"], "limit": None, "num_fewshot": None}, key)
    assert not _same_key({"tasks": ["a", "b"], "limit": None, "num_fewshot": None, "max_length": 64}, key)
    assert not _same_key({"tasks": ["a"], "limit": None, "num_fewshot": None}, key) and not _same_key(None, key)


@pytest.mark.slow
def test_bench_eval_smoke(capsys):
    """`make bench-eval`, shortened: both sides score the same requests and the table compares them."""
    from hpctrain.tools import bench_eval

    doc = bench_eval.main(["--model", "nano", "--docs", "8", "--repeats", "1", "--batch", "4", "--threads", "1"])
    out = capsys.readouterr().out
    assert doc["requests"] > 32 and set(doc["rates"]) == {"hpctrain", "lm-eval hf"} and "vs lm-eval hf" in out, out


@pytest.mark.timeout(420)
def test_eval_jobs_score_each_checkpoint_once_and_a_killed_one_is_reported(slurm, slurm_jobs, local_tasks, demo_data,
                                                                           tmp_path):
    """eval.mode=job on the local cluster: a Slurm job per checkpoint (steps 2, 4, 6), each pinning its checkpoint
    against rotation until it ends; the first attempt ends without waiting. The resumed attempt adopts them, submits
    step 8's, which is killed while the run goes on: the run reports it (exit 0, every step), waits (eval.wait_min)
    for the others and forwards their records into its metrics, TensorBoard, MLflow and W&B (on its eval/step axis)
    at their steps. A finished eval job requeued with scontrol does not score twice."""
    import re

    from helpers import cli_args, run_forked, wait_job

    from hpctrain import cli
    from hpctrain.core.files import read_evals, read_metrics
    from hpctrain.storage.checkpoint import pins

    run = tmp_path / "run"
    args = ["train.ckpt_every=2", "eval.every=2", "eval.mode=job", "+eval.cluster.time_min=5", "train.ckpt_keep=1",
            "model.tie_embeddings=false", "train.progress=false", "eval.tasks=[hpc_mc,hpc_ppl]",
            f"eval.include_path={local_tasks}"]
    trained = run_forked(cli.main, cli_args(run, demo_data, "train.max_steps=6", *args), cwd=tmp_path,
                         env={"HF_DATASETS_OFFLINE": "1"})
    assert trained.code == 0, trained.err
    submitted = dict(re.findall(r"eval job (\d+) submitted for checkpoint \S+step-0*(\d+)", open_text(run / "train.log")))
    jobs = {int(step): job for job, step in submitted.items()}
    slurm_jobs.extend(jobs.values())
    assert sorted(jobs) == [2, 4, 6], submitted
    assert sorted(p["step"] for p in pins(str(run))) == [2, 4, 6]  # (ckpt_keep=1: the pinned ones stay)
    assert (run / "checkpoints" / "step-0000002").is_dir()
    # Step 8's job killed as soon as the resumed run has submitted it (a shell beside the run watches its log).
    killer = subprocess.Popen(["bash", "-c", "until j=$(grep -oP 'eval job \\K[0-9]+(?= submitted for checkpoint "
                               "\\S+step-0000008)' \"$1\"); do sleep 0.2; done; scancel \"$j\"; echo \"$j\"", "-",
                               str(run / "train.log")], stdout=subprocess.PIPE, text=True)
    try:
        # (it may wait its eval.wait_min, 3 minutes, for the eval jobs: more than run_forked's default 120 s)
        resumed = run_forked(cli.main, cli_args(run, demo_data, "train.max_steps=8", *args, "eval.wait_min=3",
                                                "logging.trackers=[tensorboard,mlflow,wandb]"), cwd=tmp_path,
                             env={"HF_DATASETS_OFFLINE": "1"}, timeout=240)
        job8 = killer.communicate(timeout=30)[0].strip()
    finally:
        killer.kill()
    slurm_jobs.append(job8)
    assert resumed.code == 0, resumed.err
    assert json.loads(open_text(run / "result.json"))["steps"] == 8
    log = open_text(run / "train.log")
    assert re.search(rf"eval job {job8} for step 8 ended CANCELLED\S* without a result: training goes on", log), log
    assert {wait_job(job) for job in jobs.values()} == {"completed"}
    assert sorted(r["step"] for r in read_evals(str(run))) == [2, 4, 6]
    assert {2, 4, 6} <= {m["step"] for m in read_metrics(str(run)) if "eval/hpc_mc/acc" in m}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tb"))
    board.Reload()
    # (the trackers are the resumed attempt's; step 2's record may have reached the first attempt's metrics already)
    assert {4, 6} <= {e.step for e in board.Scalars("eval/hpc_mc/acc")}  # at the checkpoints' steps
    from test_trackers import _client, _history, _wandb

    ids = json.loads(open_text(run / "trackers.json"))
    assert {4, 6} <= set(_history(_client(f"sqlite:///{run}/mlflow/mlflow.db"), ids["mlflow"]["run_id"],
                                  "eval/hpc_mc/acc"))
    late = [row for row in _wandb(run)["history"].values() if "eval/hpc_mc/acc" in row]  # W&B: on eval/step
    assert {4, 6} <= {row["eval/step"] for row in late}, late
    assert pins(str(run)) == []
    # A requeue runs the finished job again (its checkpoint rotated away meanwhile): it finds its record.
    subprocess.run(["scontrol", "requeue", jobs[6]], check=True, timeout=30)
    assert wait_job(jobs[6]) == "completed"
    assert [r["step"] for r in read_evals(str(run))].count(6) == 1
    outputs = " ".join(open_text(p) for p in (run / "eval_jobs" / jobs[6]).glob("*_log.*"))
    assert "was scored already with these tasks (step 6 in evals.jsonl): not scored again" in outputs, outputs


def test_pins_and_slurm_text_stay_what_they_are(make_cfg, local_tasks, tmp_path):
    """A pin's name reaches a path (`hpctrain eval unpin=NAME`): a separator or a leading dot is refused, and unpin
    removes only a pin's own file. Cluster text becomes #SBATCH lines: a newline is refused, in `cluster` and in
    eval.cluster, before anything is submitted."""
    from omegaconf import OmegaConf

    from hpctrain.core.errors import CheckpointError
    from hpctrain.runs.resolve import resolve
    from hpctrain.storage import checkpoint
    from hpctrain.training import eval_jobs

    (tmp_path / "keep").write_text("not a pin")
    for bad in ("../keep", "a/b", ".hidden", ""):
        with pytest.raises(CheckpointError, match="pin name"):
            checkpoint.unpin(str(tmp_path), 2, bad)
    assert (tmp_path / "keep").exists()
    checkpoint.pin(str(tmp_path), 2, "eval-1-2", job="7")
    assert checkpoint.pinned(str(tmp_path)) == {2} and checkpoint.pins(str(tmp_path))[0]["job"] == "7"
    checkpoint.unpin(str(tmp_path), 2, "eval-1-2")
    assert checkpoint.pinned(str(tmp_path)) == set()
    cfg = make_cfg()
    OmegaConf.update(cfg, "cluster.partition", "gpu\n#SBATCH --uid=0")
    with pytest.raises(ConfigError, match="cluster.partition=.* holds a newline"):
        resolve(cfg)
    job = make_cfg("eval.tasks=[hpc_mc]", "eval.mode=job", "+eval.cluster.qos=a\tb").eval
    with pytest.raises(ConfigError, match="eval.cluster.qos=.* holds a newline or control character"):
        eval_jobs.check(job, make_cfg().train, True, make_cfg().cluster, make_cfg().parallel)
