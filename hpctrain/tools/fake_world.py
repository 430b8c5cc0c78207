"""`hpctrain bench world` (`make bench-world`): one rank of an 8- to 8,192-rank job, on this machine.

PyTorch's fake process group (torch.testing._internal.distributed.fake_pg) answers every collective at once without
moving data, so one process runs a rank's host-side code as it would run in a world of any size: the process group,
the device mesh and its groups (`Layout.build_mesh`), the model parallelized and its shards initialised
(`build_model`), the stop vote of a few steps (`StopSignals.agreed`), the gather of every rank's memory peaks
(`Peaks.report`), and the checkpoint's save planning: this rank's DCP plan, and the coordinator's global plan and
metadata built by DCP's own planner from every rank's plan (the others' derived from this rank's with PyTorch's
own shard arithmetic, `_compute_local_shape_and_global_offset`, one representative rank per pipeline stage built
for real). Each world size runs in a process of its own; the table shows what grows with the world.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import resource
import subprocess
import sys
import time

WORLDS = (8, 64, 1024, 8192)
MODEL = {"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 2816, "vocab_size": 32000,
         "max_seq_len": 256}


def layout_for(world: int) -> dict[str, int]:
    """A layout of `world` ranks as large jobs use them: tp 8 inside a node, pp up to 8 stages, dp the rest."""
    tp = min(8, max(2, world // 4))
    pp = min(8, max(2, world // (tp * 8)))
    return {"dp": world // (tp * pp), "tp": tp, "pp": pp}


def _fake_group(rank: int, world: int) -> None:
    """This process as `rank` of `world` under PyTorch's fake process group (collectives answer at once)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stage_model(parallel, layout, mesh, stage_rank: int, world: int):
    """The model parallelized as rank `stage_rank` holds it (its stage, dp and tp coordinate 0), on the meta device:
    what its checkpoint holds, without allocating."""
    import torch.distributed as dist

    from hpctrain.core.config import ModelConfig
    from hpctrain.models import spec_of
    from hpctrain.parallel.parallelize import parallelize

    dist.destroy_process_group()
    _fake_group(stage_rank, world)
    mesh = layout.build_mesh("cpu")
    cfg = ModelConfig(**MODEL)
    spec = spec_of(cfg)
    import torch

    with torch.device("meta"):
        model = spec.build(spec.args(cfg))
    return parallelize(model, layout, mesh, parallel, spec, torch.float32)


def _stage_plans(model, planner_type) -> list:
    """Every rank's save plan of one pipeline stage: this rank's from DCP, the others' by moving its shards to their
    mesh coordinates."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    state = get_model_state_dict(model)
    planner = planner_type()
    planner.set_up_planner(state, is_coordinator=False)
    mine = planner.create_local_plan()
    meshes = {v.device_mesh.mesh.shape for v in state.values() if isinstance(v, DTensor)}
    assert len(meshes) == 1, meshes  # one (dp, tp) mesh per stage: its coordinates are the stage's ranks
    shape = next(iter(meshes))
    plans = []
    for coordinate in itertools.product(*(range(n) for n in shape)):
        items = []
        for item in mine.items:
            value = state.get(item.index.fqn)
            if item.type != WriteItemType.SHARD or not isinstance(value, DTensor):
                items.append(item)
                continue
            sizes, offsets = _compute_local_shape_and_global_offset(value.shape, shape, list(coordinate),
                                                                    value.placements)
            items.append(WriteItem(index=MetadataIndex(item.index.fqn, torch.Size(offsets)), type=item.type,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                  sizes=torch.Size(sizes)),
                                       properties=item.tensor_data.properties, size=item.tensor_data.size)))
        plans.append(SavePlan(items, planner_data=mine.planner_data))
    return plans


def _training_step(world: int) -> dict:
    """Two training steps (the second timed) of rank 0 in a dp × tp8 layout with ZeRO-3 and sequence parallelism:
    the step's host-side control flow at this world size (the fake group's collectives return no data: the loss is
    whatever the rank's own numbers give). Not pipelined: torch.distributed.pipelining sends pickled shape metadata
    between stages before the first step, which a fake group cannot answer."""
    import torch

    from hpctrain.core.config import ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig
    from hpctrain.parallel.layout import Layout
    from hpctrain.training.model_init import build_model
    from hpctrain.training.optimizer import build_optimizer
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import build_train_step

    tp = min(8, world)
    parallel = ParallelConfig(dp=world // tp, tp=tp, zero_stage=3, sequence_parallel=True)
    layout = Layout.from_config(parallel, world)
    mesh = layout.build_mesh("cpu")
    cpu = torch.device("cpu")
    model = build_model(ModelConfig(**MODEL), parallel, layout, mesh, cpu, torch.float32, 0)
    step = build_train_step(model, build_optimizer(model, OptimConfig(), 1e-3), setup_precision(PrecisionConfig(), cpu),
                            cpu, mesh, layout, grad_clip=1.0, grad_accum=2)
    batches = [torch.randint(0, MODEL["vocab_size"], (1, 65), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    step(iter(batches), n_tokens=128 * layout.dp)
    t = time.perf_counter()
    result = step(iter(batches), n_tokens=128 * layout.dp)
    return {"step_s": round(time.perf_counter() - t, 4), "step_status": result.status.value,
            "step_layout": f"{layout.dp}×{tp}×1"}


def one_world(world: int, global_plan: bool = True) -> dict:
    """Rank 0 of a `world`-rank job: what its start-up, a step's control flow and a save plan cost. Without
    `global_plan` only rank 0's own save plan is made (deriving 8,192 ranks' plans takes this harness a minute)."""
    from hpctrain.training.gc_schedule import importing

    with importing():  # as a rank imports (training/gc_schedule.py)
        import torch

        from hpctrain.core.config import ModelConfig, ParallelConfig
        from hpctrain.monitoring.memory import Peaks
        from hpctrain.parallel.layout import Layout
        from hpctrain.runtime.job import StopSignals
        from hpctrain.training.model_init import build_model

    out = {"world": world, **layout_for(world)}
    times = {}
    t = time.perf_counter()
    _fake_group(0, world)
    parallel = ParallelConfig(**layout_for(world), zero_stage=3, sequence_parallel=True)
    layout = Layout.from_config(parallel, world)
    times["process_group_s"] = time.perf_counter() - t
    t = time.perf_counter()
    mesh = layout.build_mesh("cpu")
    times["mesh_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model = build_model(ModelConfig(**MODEL), parallel, layout, mesh, torch.device("cpu"), torch.float32, 0)
    times["model_s"] = time.perf_counter() - t
    signals = StopSignals("USR2")
    t = time.perf_counter()
    for _ in range(10):
        signals.agreed()
    times["vote_ms_per_step"] = (time.perf_counter() - t) * 100
    signals.restore()
    t = time.perf_counter()
    Peaks(1, 1.0, 2).report(2, world)
    times["peaks_gather_s"] = time.perf_counter() - t
    out["startup_s"] = times["process_group_s"] + times["mesh_s"] + times["model_s"]
    out.update(_training_step(world))  # (before the save plans: deriving them starts the process group again)
    out.update(_save_plans(model, parallel, layout, mesh, world, times, global_plan))
    out["rss_mb"] = _rss_mb()
    return {**out, **{k: round(v, 4) for k, v in times.items()}}


def _save_plans(model, parallel, layout, mesh, world: int, times: dict, global_plan: bool) -> dict:
    """Rank 0's DCP save plan; with `global_plan`, every rank's and the coordinator's global plan and metadata."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    t = time.perf_counter()
    if not global_plan:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        planner = DefaultSavePlanner()
        planner.set_up_planner(get_model_state_dict(model), is_coordinator=True)
        items = len(planner.create_local_plan().items)
        times["local_plans_s"] = time.perf_counter() - t
        return {"local_items": items}
    plans = []
    for stage in range(layout.pp):  # one real rank per stage; the others of its stage derived from it
        staged = _stage_model(parallel, layout, mesh, stage * world // layout.pp, world)
        plans += _stage_plans(staged, DefaultSavePlanner)
    times["local_plans_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _, metadata = DefaultSavePlanner().create_global_plan(plans)
    times["global_plan_s"] = time.perf_counter() - t
    return {"plans": len(plans), "metadata_bytes": len(pickle.dumps(metadata)),
            "chunks": sum(len(m.chunks) for m in metadata.state_dict_metadata.values() if hasattr(m, "chunks"))}


def measure(worlds=WORLDS, timeout_s: float = 600, global_plan: bool = True) -> list[dict]:
    """Each world size in a fresh process (the fake process group is the process's)."""
    rows = []
    for world in worlds:
        p = subprocess.run([sys.executable, "-m", "hpctrain.tools.fake_world", "--one", str(world),
                            *([] if global_plan else ["--local-only"])],
                           capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})  # (fake groups take no timeout)
        if p.returncode != 0:
            raise RuntimeError(f"world {world}: {p.stderr.strip()[-2000:]}")
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| world | dp×tp×pp | start-up s (pg + mesh + model) | vote ms/step | peaks gather s | save plans s "
           "(local + global) | metadata KB | chunks | a step s (dp×tp×pp) | RSS MB |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['world']:,} | {r['dp']}×{r['tp']}×{r['pp']} | {r['startup_s']:.2f} ({r['process_group_s']:.2f}"
                   f" + {r['mesh_s']:.2f} + {r['model_s']:.2f}) | {r['vote_ms_per_step']:.3f} | "
                   f"{r['peaks_gather_s']:.3f} | {r['local_plans_s']:.2f} + {r.get('global_plan_s', 0):.2f} | "
                   f"{r.get('metadata_bytes', 0) / 1024:,.0f} | {r.get('chunks', 0):,} | "
                   f"{r['step_s']:.2f} ({r['step_layout']}) | {r['rss_mb']:,.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from hpctrain.core.argparser import Parser

    parser = Parser(prog="hpctrain bench world", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes, comma-separated")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--local-only", action="store_true", help="rank 0's save plan only, not the global one")
    args = parser.parse_args(argv)
    if args.one:
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(one_world(args.one, not args.local_only)))
        return 0
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds {args.worlds}: world sizes are integers, e.g. 8,64,1024")
    if any(w < 8 or w & (w - 1) for w in worlds):
        parser.error(f"--worlds {args.worlds}: powers of two from 8")
    print(table(measure(worlds, global_plan=not args.local_only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
