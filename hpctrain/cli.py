"""`python -m hpctrain`: train (a Hydra app; `hydra/launcher=slurm|local` submits instead), `plan`, `preflight`.

Every bad input ends in one line `hpctrain: error: ...` and exit code 2, Hydra's composition errors
included, and leaves no run directory behind.
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.core.config import unknown_key_message
from hpctrain.core.errors import BAD_INPUT, EXIT_BAD_INPUT, EXIT_INTERRUPTED, fail
from hpctrain.core.files import no_space
from hpctrain.runs import rundir
from hpctrain.runs.compose import compose, conf_dir, register
from hpctrain.runs.hf_shape import shape_from_checkpoint
from hpctrain.training.gc_schedule import importing

PROG = "python -m hpctrain"
# When the command started: what was made after it (by Hydra, for this run) may be removed again.
_started = float("inf")  # (until main runs: nothing counts as made by this command)
_full_error: str | None = None  # the user's HYDRA_FULL_ERROR, restored on return
_in_task = False  # Hydra has made the run directory and handed over

register()


def _restore_full_error() -> None:
    if _full_error is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = _full_error


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def _task(cfg: DictConfig) -> dict | None:
    with importing():
        from hpctrain.parallel.process_group import launched_rank
        from hpctrain.runtime.job import Stopped, quiet_other_ranks
        from hpctrain.training.run import check_checkpoint_space, prepare, start, train

    global _in_task
    _in_task = True
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    where = f"sweep point #{hc.job.num} ({_sweep_values(hc.overrides.task)}): " if hc.mode == RunMode.MULTIRUN else ""
    try:  # model.init_from=hf:DIR: the model's shape from its config.json, before the run is submitted or checked
        shape_from_checkpoint(cfg, hc.overrides.task, run_dir)
    except BAD_INPUT as e:
        rundir.remove_if_fresh(run_dir, _started)
        fail(where + str(e))
    if hc.mode == RunMode.RUN and str(hc.launcher.get("_target_", "")).startswith("hydra_plugins.hpctrain_launcher."):
        # `python -m hpctrain hydra/launcher=slurm ...`: submit this one run instead of training here.
        from hydra.utils import instantiate

        return instantiate(hc.launcher).submit_run(cfg, run_dir, OmegaConf.to_container(hc.job_logging, resolve=True),
                                                   started=_started)
    quiet_other_ranks()
    try:
        if launched_rank() == 0:
            rundir.check_owned(run_dir)  # before anything (a log line) is written into someone else's directory
        prepared = prepare(cfg, run_dir=run_dir)
        check_checkpoint_space([prepared.checkpoint], run_dir, cfg.train.ckpt_keep, cfg.train.resume)
    except BAD_INPUT as e:
        rundir.remove_if_fresh(run_dir, _started)
        fail(where + str(e))
    try:
        with rundir.claimed(run_dir):  # one run at a time, from here to the end of training
            try:
                if launched_rank() == 0:
                    start(cfg, run_dir, prepared.shape.dp)  # a previous run moved aside, where it resumes checked: before the record
                rundir.save_config(run_dir, cfg)
            except OSError as e:
                fail(f"cannot write to the run directory {run_dir} ({e.strerror}: {e.filename}): choose a writable "
                     "run_dir")
            return train(cfg, run_dir, prepared)
    except BAD_INPUT as e:
        fail(where + str(e))
    except OSError as e:
        full = no_space(e, run_dir)
        if not full:
            raise
        fail(f"{where}{full} (writing {e.filename}): free space, then resume (train.resume=auto)", code=1)
    except Stopped as e:
        print(f"hpctrain: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def _sweep_values(task_overrides) -> str:
    """This point's values of the keys the command sweeps (`optim.lr=1e-3,3e-3` -> `optim.lr=3e-3`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse = OverridesParser.create().parse_overrides
    try:  # (inside a submitted job argv is submitit's: then all of the point's overrides are shown)
        swept = {o.key_or_group for o in parse([a for a in sys.argv[1:] if "=" in a]) if o.is_sweep_override()}
        if swept:
            return " ".join(o.input_line for o in parse(list(task_overrides)) if o.key_or_group in swept)
    except HydraException:  # an argument that is not an override after all
        pass
    return " ".join(task_overrides)


def hydra_error_line(e: BaseException) -> str:
    """Hydra's multi-line composition errors as one line; an unknown key gets hpctrain's own advice (Hydra's
    suggests `+key=value`, which would add the typo silently)."""
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    if key and str(e).startswith("Could not override"):
        return unknown_key_message(key)
    missing, options = getattr(e, "missing_cfg_file", None), getattr(e, "options", None)
    if missing and options:  # `model=llama_8b`
        group, _, name = missing.rpartition("/")
        return f"{group}={name} is not an option of the config group {group}: use one of {', '.join(options)}"
    parts = [str(e)] + ([str(cause)] if isinstance(cause, OmegaConfBaseException) else [])
    if getattr(e, "override", None):
        parts.insert(0, f"cannot parse override {e.override!r}")
    keep = [" ".join(line.strip() for line in part.splitlines() if line.strip() and not line.strip().startswith(
        ("full_key:", "reference_type=", "object_type=", "See "))) for part in parts]
    return ": ".join(k for k in keep if k)


def _hydra(argv: list[str]) -> int:
    global _full_error
    _full_error = os.environ.get("HYDRA_FULL_ERROR")
    # Composition errors (of every sweep point too) reach us as exceptions instead of Hydra's multi-line
    # report; a crash in training then shows Python's whole traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.argv = [PROG, *argv]  # Hydra's usage lines name the program by argv[0]
    try:
        if "-m" in argv or "--multirun" in argv:
            _announce_sweep(argv)
        _task()
    except (HydraException, OmegaConfBaseException) as e:
        fail(hydra_error_line(e))
    except OSError as e:
        if _in_task:  # a failure of training itself keeps its traceback
            raise
        what = "is a file" if e.filename and os.path.isfile(e.filename) else f"cannot be created ({e.strerror})"
        fail(f"the run directory {e.filename} {what}: choose another run_dir")
    finally:
        _restore_full_error()
    return 0


SWEEP_ANNOUNCED = 50  # points from which a sweep says how many it composes first


def _announce_sweep(argv: list[str]) -> None:
    """Before Hydra's sweeper composes every point of a sweep (a tenth of a second each, minutes for thousands, in
    silence): how many there are, and, bound for Slurm, whether one job array holds them (one line otherwise)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hpctrain.launch.submit import check_array_size

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
        points = 1
        for o in parsed:
            if o.is_sweep_override() and not o.is_hydra_override():
                points *= len(list(o.sweep_string_iterator()))
    except Exception:  # noqa: BLE001 - a sweep this cannot count (an interval): Hydra words any problem
        return
    if any(o.key_or_group == "hydra/launcher" and o.value() == "slurm" for o in parsed):
        try:
            check_array_size(points)
        except BAD_INPUT as e:
            fail(str(e))
    if points >= SWEEP_ANNOUNCED:
        print(f"hpctrain: {points} sweep points: each is composed and checked before anything is submitted "
              "(about 0.1 s a point)", flush=True)


def plan(argv: list[str]) -> int:
    """Compose the same config as a run (no run directory, no logging setup) and print its layout plan; with
    --search, the fastest layouts of the model on --gpus N that fit; with --validate, the step-time model against
    published runs."""
    from hpctrain.core.argparser import Parser

    parser = Parser(prog=f"{PROG} plan", description="the layer-to-stage map, per-device memory, pipeline bubble, "
                    "FLOPs and predicted step time of a layout (nothing is allocated)",
                    epilog="e.g. model=llama_70b parallel.dp=8 parallel.tp=8 parallel.pp=4 cluster.gpu_mem_gb=80 "
                    "cluster.gpu_type=H100")
    parser.add_argument("--search", action="store_true", help="the fastest layouts of --gpus GPUs that fit memory "
                        "(needs cluster.gpu_type, cluster.gpu_mem_gb, train.global_batch, train.seq_len)")
    parser.add_argument("--gpus", type=int, help="GPUs to search layouts for")
    parser.add_argument("--top", type=int, default=5, help="layouts shown (default 5)")
    parser.add_argument("--write", metavar="FILE", help="write the fastest as a parallel= config file (a new file)")
    parser.add_argument("--validate", action="store_true",
                        help="the step-time model against published runs (with --search: what the search picks)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for a run")
    args = parser.parse_args(argv)
    if args.validate:
        from hpctrain.training import published

        print(published.table())
        if args.search:
            print("\n" + published.search_table())
        return 0
    if (args.gpus or args.write) and not args.search:
        parser.error("--gpus and --write go with --search")
    if args.search and (not args.gpus or args.gpus < 1 or args.top < 1):
        parser.error("--search needs --gpus N (N >= 1) and --top >= 1")
    try:
        cfg = compose(args.overrides)
    except (HydraException, OmegaConfBaseException) as e:
        fail(hydra_error_line(e))
    if args.search:
        with importing():
            from hpctrain.training import layout_search

        try:
            text, found = layout_search.report(cfg, args.gpus, args.top)
        except BAD_INPUT as e:
            fail(str(e))
        print(text)
        if args.write and not found:
            fail(f"--write {args.write}: no layout fits, nothing written")
        if args.write:
            try:
                layout_search.write_parallel(args.write, found[0], cfg.parallel)
            except FileExistsError:
                fail(f"{args.write} exists: --write makes a new file, choose another name")
            except OSError as e:
                fail(f"cannot write {args.write} ({e.strerror}): choose a writable path")
            print(f"wrote {args.write}: use it as parallel={os.path.splitext(os.path.basename(args.write))[0]} (in "
                  f"conf/parallel/) with train.micro_batch={found[0].candidate.micro_batch} train.grad_accum=null")
        return 0
    with importing():
        from hpctrain.training.planner import main as plan_main

    return plan_main(cfg)


def preflight(argv: list[str]) -> int:
    with importing():
        from hpctrain.launch.preflight import main as preflight_main

    return preflight_main(argv)


def check_grid(argv: list[str]) -> int:
    """`python -m hpctrain check [--dir DIR] key=v1,v2 ... [-- overrides]`: every point of the grid checked as its
    job would check it at its start (config, layout, data), the cluster's array limit, and with --dir that the
    points' first checkpoints fit in what DIR's filesystem has free; one line and exit 2 at the first bad point.
    sbatch/sweep.sbatch runs it before it submits anything."""
    with importing():
        from hpctrain.core.config import ConfigError
        from hpctrain.launch.submit import Progress, check, check_array_size, grid
        from hpctrain.training.run import check_checkpoint_space

    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {PROG} check [--dir DIR] key=v1,v2 [key=v1,v2 ...] [-- overrides]\nchecks every point of the "
              "grid as its job would at its start (config, layout, data), the cluster's job-array limit and, with "
              "--dir, that the points' first checkpoints fit in DIR's filesystem; submits nothing")
        return 0
    sweep_dir, argv = (argv[1], argv[2:]) if argv[:1] == ["--dir"] and len(argv) > 1 else (None, argv)
    points, checkpoints = grid(argv), []
    try:
        check_array_size(len(points))
    except ConfigError as e:
        fail(str(e))
    progress = Progress(len(points))
    for i, overrides in enumerate(points):
        try:
            cfg = compose(overrides)
            checkpoints.append(check(cfg).checkpoint)
        except (HydraException, OmegaConfBaseException) as e:
            fail(f"sweep point #{i} ({' '.join(overrides)}): {hydra_error_line(e)}")
        except (*BAD_INPUT, OSError) as e:
            fail(f"sweep point #{i} ({' '.join(overrides)}): {e}")
        progress.tick(i + 1)
    if sweep_dir is not None:
        try:
            check_checkpoint_space(checkpoints, sweep_dir, cfg.train.ckpt_keep)
        except BAD_INPUT as e:
            fail(str(e))
    print(f"hpctrain: {len(points)} sweep point{'s' if len(points) != 1 else ''} checked")
    return 0


def _tool(module: str, *head: str):
    def run(argv: list[str]) -> int:
        import importlib

        with importing():
            tool = importlib.import_module(module)
        code = tool.main([*head, *argv])
        return code if isinstance(code, int) else 0  # (bench returns its measurements)
    return run


PREP = {"tokenizer": ("data_prep.tokenizer", ()), "shards": ("data_prep.shards", ()),
        "merge": ("data_prep.shards", ("merge",)), "verify": ("data_prep.verify", ()), "demo": ("data_prep.demo", ()),
        "synthetic": ("data_prep.synthetic", ())}
BENCHES = {"data": ("data_prep.bench", "hpctrain.tools.bench_data"), "host": ("hpctrain.tools.bench_host",),
           "scale": ("hpctrain.tools.bench_scale",), "ckpt": ("hpctrain.tools.bench_ckpt",),
           "monitor": ("hpctrain.tools.bench_monitor",), "comm": ("hpctrain.tools.bench_comm",),
           "gpu": ("hpctrain.tools.bench_gpu",), "eval": ("hpctrain.tools.bench_eval",),
           "moe": ("hpctrain.tools.bench_moe",), "world": ("hpctrain.tools.fake_world",)}


def prep(argv: list[str]) -> int:
    """`hpctrain prep STEP ...`: the data_prep commands (their own arguments; STEP --help for them)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: hpctrain prep {{{','.join(PREP)}}} [arguments]   (STEP --help for its own)\n"
              "  tokenizer  train a BPE tokenizer on a corpus\n  shards     a corpus into token shards + manifest\n"
              "  merge      finish a Slurm array build\n  verify     check a shard set\n  demo       the demo data\n"
              "  synthetic  random tokens in any vocabulary (benchmarks, GPU runs)")
        return 0 if argv else EXIT_BAD_INPUT
    if argv[0] not in PREP:
        fail(f"prep {argv[0]!r} is not a step: use one of {', '.join(PREP)} (hpctrain prep --help)")
    module, head = PREP[argv[0]]
    return _tool(module, *head)(argv[1:])


def bench(argv: list[str]) -> int:
    """`hpctrain bench [NAME] ...`: the throughput benchmark, or the one NAME names (data, host, scale, ...)."""
    if argv and argv[0] in BENCHES:
        code = 0
        for module in BENCHES[argv[0]]:
            code = code or _tool(module)(argv[1:])
        return code
    if argv and not argv[0].startswith("-"):
        fail(f"bench {argv[0]!r} is not a benchmark: use one of {', '.join(BENCHES)}, or none for the throughput one")
    return _tool("hpctrain.tools.bench")(argv)


# Every command but training, by name: `python -m hpctrain NAME ...` and `hpctrain NAME ...` alike. (A training
# run's arguments are Hydra overrides, key=value: no command name can be mistaken for one.)
COMMANDS = {
    "plan": ("layer map, memory per device, bubble and FLOPs of a layout; allocates nothing", plan),
    "preflight": ("cluster health check (GEMM, all-reduce, per node)", preflight),
    "check": ("every point of a grid checked as its job would, nothing submitted: check [--dir DIR] key=v1,v2 "
              "[-- overrides]", check_grid),
    "generate": ("sample text from a run: generate run_dir=DIR prompt=TEXT", _tool("hpctrain.tools.generate")),
    "export-hf": ("a run's checkpoint as a transformers model: export-hf RUN_DIR OUT",
                  _tool("hpctrain.weights.export_hf")),
    "summary": ("a run's status and loss curve in one line: summary RUN_DIR", _tool("hpctrain.tools.summary")),
    "eval": ("downstream tasks (lm-eval) on a run's checkpoints: eval RUN_DIR 'eval.tasks=[...]'",
             _tool("hpctrain.tools.evaluate")),
    "report": ("a sweep's table and plots: report SWEEP_DIR", _tool("hpctrain.launch.sweep", "report")),
    "nodes": ("the bad-node list submissions leave out: nodes [clear [NODE ...]]", _tool("hpctrain.tools.nodes")),
    "bench": (f"throughput against a plain transformers loop; bench NAME: {', '.join(BENCHES)}", bench),
    "prep": (f"data preparation: prep {{{','.join(PREP)}}} ...", prep),
    "gpu-check": ("on a GPU node: the GPU tests and a throughput run in one table", _tool("hpctrain.tools.gpu_check")),
}


def main(argv: list[str] | None = None) -> int:
    """`python -m hpctrain [COMMAND] ...`: without a command, the arguments are a training run's Hydra overrides."""
    global _started
    _started = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]][1](argv[1:])
        return _hydra(argv)
    except KeyboardInterrupt:  # a run's result.json says "interrupted"; its last complete checkpoint stays
        print("hpctrain: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


# The `hpctrain` console script: `train` and the commands above.
TOOLS = {"train": ("train here, or submit with hydra/launcher=slurm|local (= python -m hpctrain ...)", main),
         **COMMANDS}


def console(argv: list[str] | None = None) -> int:
    """`hpctrain COMMAND [arguments]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hpctrain COMMAND [arguments]   (COMMAND --help for its own)\n\ncommands:\n" + "\n".join(
            f"  {name:10} {text}" for name, (text, _) in TOOLS.items()))
        return 0 if argv else EXIT_BAD_INPUT
    if argv[0] not in TOOLS:
        fail(f"unknown command {argv[0]!r}: use one of {', '.join(TOOLS)} (hpctrain --help)")
    return main(argv[1:] if argv[0] == "train" else argv)  # (main dispatches the other commands)
