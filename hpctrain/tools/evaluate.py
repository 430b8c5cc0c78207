"""`hpctrain eval RUN_DIR [checkpoint=DIR|all] [key=value ...]`: a finished (or running) run's checkpoint scored on
downstream tasks (lm-evaluation-harness, the eval group), in the run's layout or another one, written into the run
(<run_dir>/evals.jsonl) and printed as a table; a sweep directory: every run in it, one table.

  hpctrain eval outputs/run 'eval.tasks=[hellaswag]' eval.limit=200
  hpctrain eval outputs/run checkpoint=all 'eval.tasks=[my_mc]' eval.include_path=/lustre/tasks parallel=fsdp
  hpctrain eval multirun/2026-11-27/10-00-00 'eval.tasks=[my_mc]'

key=value: any eval.* key (eval.tasks is required unless the run's config has tasks), parallel=NAME or parallel.*
and precision=NAME (the layout and precision to score in; default: the run's), cluster.num_threads; once=true: a
checkpoint scored already with these tasks and settings is not scored again; unpin=NAME: the pin of that name removed
at the end (an eval job's: eval.mode=job).
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

from hpctrain.core.errors import ConfigError

GROUPS = ("parallel", "precision")  # config groups whose option may be chosen by name
KEYS = ("eval.", "parallel.", "cluster.num_threads")  # the keys an override may set
OWN = ("checkpoint", "once", "unpin")  # the command's own keys


def runs_of(path: str) -> list[str]:
    """`path` if it is a run directory, else the run directories in it (a sweep's points), in order."""
    if os.path.exists(os.path.join(path, ".hydra", "config.yaml")):
        return [path]
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory: pass a training run's directory or a sweep's")
    found = sorted((d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, ".hydra", "config.yaml"))),
                   key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d))
    if not found:
        raise ConfigError(f"{path} holds no training run (no .hydra/config.yaml in it or its subdirectories)")
    return [os.path.join(path, d) for d in found]


def configured(run_dir: str, overrides: list[str]):
    """The run's config with the overrides applied (group options read from conf/)."""
    from hpctrain.core.config import Config
    from hpctrain.runs.compose import conf_dir
    from hpctrain.runs.rundir import run_config

    saved, _ = run_config(run_dir)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)  # typed and checked by the schema
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"{item!r} is not key=value")
        if key in GROUPS:
            option = os.path.join(conf_dir(), key, f"{value}.yaml")
            if not os.path.isfile(option):
                raise ConfigError(f"{key}={value} is not an option: see conf/{key}/")
            cfg[key] = OmegaConf.merge(cfg[key], OmegaConf.load(option))
        elif key.startswith(KEYS):
            cfg.merge_with(OmegaConf.from_dotlist([item]))
        else:
            raise ConfigError(f"{key}= cannot be set by eval: use eval.*, parallel=NAME, parallel.*, precision=NAME or "
                              "cluster.num_threads")
    if not cfg.eval.tasks:
        raise ConfigError("no task to score: pass 'eval.tasks=[TASK,...]' (lm-eval task names)")
    return cfg


def checkpoints(run_dir: str, which: str | None) -> list[str]:
    """The checkpoints to score: `which` (all, or one of the run's own), else the latest."""
    from hpctrain.storage import checkpoint

    if which == "all":
        found = checkpoint.complete_checkpoints(run_dir)
    elif which:
        own = os.path.realpath(checkpoint.root(run_dir))
        if os.path.realpath(os.path.dirname(os.path.normpath(which))) != own or \
                not checkpoint.is_step_dir(os.path.basename(os.path.normpath(which))):
            raise ConfigError(f"checkpoint={which} is not one of {checkpoint.root(run_dir)}/step-N: the scores go to "
                              "this run's evals.jsonl at the checkpoint's step (score another run's checkpoint with "
                              "that run's directory)")
        found = [which]
    else:
        found = [p for p in [checkpoint.latest(run_dir)] if p]
    if not found:
        raise ConfigError(f"no complete checkpoint in {run_dir}/checkpoints to score")
    return found


def table(rows: list[tuple[str, dict]]) -> str:
    """One line per scored checkpoint, a column per metric."""
    metrics = sorted({k for _, r in rows for k in r if k.startswith("eval/")})
    head = ["run", "step", *(m[len("eval/"):] for m in metrics)]
    body = [[name, str(r["step"]), *(f"{r[m]:.4f}" if m in r else "-" for m in metrics)] for name, r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body])


def run(argv: list[str]) -> str:
    from hpctrain.storage.checkpoint import step_of, unpin
    from hpctrain.training.checkpoint_eval import score_checkpoint

    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        raise ConfigError("usage: hpctrain eval RUN_DIR [checkpoint=DIR|all] [key=value ...] (hpctrain eval --help)")
    own = {k: v for k, _, v in (a.partition("=") for a in argv[1:]) if k in OWN}
    overrides = [a for a in argv[1:] if a.partition("=")[0] not in OWN]
    runs = runs_of(argv[0])
    if len(runs) > 1 and own.get("checkpoint") not in (None, "all"):
        raise ConfigError(f"checkpoint={own['checkpoint']} with the {len(runs)} runs of {argv[0]}: one checkpoint "
                          "belongs to one run; pass that run's directory, or checkpoint=all")
    # every run's config and checkpoints first: a run that cannot be scored stops the command before any is
    scoring = [(run_dir, configured(run_dir, overrides), checkpoints(run_dir, own.get("checkpoint")))
               for run_dir in runs]
    rows = []
    for run_dir, cfg, found in scoring:
        for ckpt in found:
            try:
                record = score_checkpoint(cfg, run_dir, ckpt, once=own.get("once") == "true")
            finally:
                if own.get("unpin"):
                    unpin(run_dir, step_of(ckpt), own["unpin"])
            rows.append((os.path.relpath(run_dir, argv[0]) if run_dir != argv[0] else run_dir, record))
    return table(rows)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: " + __doc__.split("`")[1] + "\n\n" + __doc__.split("\n\n", 1)[1])
        return 0
    from omegaconf.errors import OmegaConfBaseException

    from hpctrain.core.command import run_command
    from hpctrain.core.errors import BAD_INPUT
    from hpctrain.runs.rundir import RunDirError
    from hpctrain.storage.checkpoint import as_tool_says

    def work() -> None:
        with as_tool_says():
            print(run(argv))

    return run_command(work, "hpctrain eval", (*BAD_INPUT, RunDirError, OmegaConfBaseException))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
