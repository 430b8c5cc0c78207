"""Multi-process layouts (gloo, forked local ranks, one torchrun run) against one process on the same batches."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    LAYOUT_RUN,
    Forked,
    cli_args,
    deltas,
    fork_order,
    fsdp_unsharded_bytes,
    held_grad_bytes,
    model_on,
    ranks_of,
    read,
    records,
    run_layout,
    step_metrics,
    until,
)

from hpctrain import cli
from hpctrain.core.config import ConfigError
from hpctrain.runs.resolve import resolve
from hpctrain.training.run import TrainingError, train

LAYOUTS = {
    "dp2_zero0": ["parallel=ddp", "parallel.dp=2"],
    "dp2_zero2": ["parallel=zero2", "parallel.dp=2"],
    "dp2_zero3": ["parallel=fsdp", "parallel.dp=2"],
    # CPU-only machines too: the offloaded state goes to ordinary (not pinned) host memory.
    "dp2_zero3_offload": ["parallel=fsdp", "parallel.dp=2", "parallel.cpu_offload=true"],
    "tp2": ["parallel=tp2"],
    "tp2_sp": ["parallel=tp2_sp"],
    "dp2_tp2_sp_zero3": ["parallel=dp2_tp2"],
}
_refs: dict[tuple, tuple[dict, list[dict]]] = {}


def reference(make_cfg, tmp_path, *overrides, logged: bool = False):
    """One process's run with these overrides (each run once per test process): its {step: (loss, grad_norm)}, and
    with `logged` its metrics records."""
    if overrides not in _refs:
        run_dir = tmp_path / f"single-{len(_refs)}"
        _refs[overrides] = run_layout(make_cfg, run_dir, *overrides), records(run_dir)
    return _refs[overrides] if logged else _refs[overrides][0]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(make_cfg, tmp_path, layout):
    """fp32, with accumulation: the loss (global mean) and the clipped-across-meshes grad norm match."""
    ref = reference(make_cfg, tmp_path)
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / layout, *LAYOUTS[layout]))
    print(f"{layout}: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
def test_activation_checkpointing_with_tp_sp_fsdp(make_cfg, tmp_path):
    ref = reference(make_cfg, tmp_path)
    got = run_layout(make_cfg, tmp_path / "ac", "parallel=dp2_tp2", "parallel.activation_checkpointing=full")
    dloss, dnorm = deltas(ref, got)
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
def test_qwen3_in_3d_equals_one_process(make_cfg, tmp_path):
    """The family with parallel state of its own (q/k norms, replicated DTensors over the heads each tp rank holds,
    then sharded by FSDP), head_dim apart from dim/n_heads: ZeRO-3 × tp2 with sequence parallelism trains the
    losses and gradient norms of one process."""
    family = ("model.family=qwen3", "model.head_dim=32")
    ref = reference(make_cfg, tmp_path, *family)
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / "qwen3", *family, "parallel=dp2_tp2"))
    print(f"qwen3 dp2_tp2: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
def test_qwen2_biases_with_tp_without_sequence_parallel(make_cfg, tmp_path):
    """tp2 without sequence parallelism over a family whose plan leaves 1-D parameters of both kinds (sharded q/k/v
    biases, plain norms): every parameter is made a DTensor (the norms replicated), so the fused optimizer takes
    them together, and the run equals one process."""
    family = ("model.family=qwen2",)
    ref = reference(make_cfg, tmp_path, *family)
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / "qwen2", *family, "parallel=tp2"))
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["dp2_zero3", "tp2_sp", "cp2_zero3"])
def test_bf16_tracks_one_process_bf16(make_cfg, tmp_path, layout):
    # FSDP runs the blocks on gathered bf16 parameters (a bf16 residual stream); one process autocasts fp32 ones.
    # cp2_zero3: context parallel (each sequence split over 2 ranks, bf16 keys and values gathered) with FSDP over them.
    ref = reference(make_cfg, tmp_path, "precision=bf16")
    extra = ["parallel=fsdp", "parallel.dp=1", "parallel.cp=2"] if layout == "cp2_zero3" else LAYOUTS[layout]
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / layout, "precision=bf16", *extra))
    print(f"bf16 {layout}: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 2e-3 and dnorm <= 2e-2, (dloss, dnorm)


@pytest.mark.multiproc
def test_checkpoint_reshards_across_layouts(make_cfg, tmp_path):
    """Save at dp2·ZeRO-3 after 3 steps; resume with tp2 and with one process: steps 4-6 as uninterrupted."""
    six = ("train.max_steps=6", "train.ckpt_every=3")
    ref = run_layout(make_cfg, tmp_path / "ref", *six)
    run_layout(make_cfg, tmp_path / "saved", "parallel=fsdp", "parallel.dp=2", "train.ckpt_every=3")
    for name, layout in (("tp2", ["parallel=tp2_sp"]), ("single", [])):
        shutil.copytree(tmp_path / "saved", tmp_path / name, symlinks=True)
        got = run_layout(make_cfg, tmp_path / name, *six, *layout)
        assert sorted(got) == list(range(1, 7))
        for s in (4, 5, 6):
            assert abs(got[s][0] - ref[s][0]) <= 1e-5, (name, s, got[s], ref[s])
            assert got[s][1] == pytest.approx(ref[s][1], rel=1e-5), (name, s)


@pytest.mark.parametrize("overrides,world,words", [
    (["parallel=tp2"], 3, ["dp×tp×pp=1×2×1=2", "world size 3"]),
    (["parallel=tp2", "parallel.compile=true"], 2, ["parallel.compile=true", "pytorch/pytorch#143134"]),
    (["parallel.tp=3", "parallel.dp=auto"], 3, ["model.n_heads=4", "parallel.tp=3"]),
    (["parallel=tp2_sp", "train.seq_len=63"], 2, ["train.seq_len=63", "parallel.tp=2"]),
    (["parallel.pp=2", "model.n_layers=1"], 2, ["model.n_layers=1", "parallel.pp"]),
    (["parallel=fsdp", "parallel.zero_stage=1"], 2, ["zero_stage=1"]),
    (["parallel=ddp", "parallel.cpu_offload=true"], 2, ["cpu_offload", "zero_stage=0"]),
    (["parallel=fsdp", "train.global_batch=6"], 4, ["global_batch=6", "4×4"]),
])
def test_layout_errors_are_one_line(make_cfg, overrides, world, words):
    with pytest.raises(ConfigError) as e:
        resolve(make_cfg(*overrides), world)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_dp_auto_fills_the_world(make_cfg):
    plan = resolve(make_cfg("parallel=fsdp", "parallel.tp=2", "train.micro_batch=2"), 8)
    assert (plan.dp, plan.tp, plan.micro_batch, plan.grad_accum) == (4, 2, 2, 1)


@pytest.mark.multiproc
def test_sub_groups_get_the_timeout():
    """Every mesh dim's group, sub-groups included, gets cluster.pg_timeout_s (c10d would give them 30 min)."""
    from hpctrain.parallel import process_group as distributed
    from hpctrain.parallel.layout import Layout, group_timeouts
    from hpctrain.runtime import spawn as launch

    def check():
        env = distributed.init(7.0)
        mesh = Layout(pp=1, dp=2, tp=2).build_mesh(env.device.type, 7.0)
        timeouts = group_timeouts(mesh)
        distributed.shutdown()
        assert timeouts["dp"] == timeouts["tp"] == 7.0, timeouts

    launch.spawn(4, check, threads=1)


@pytest.mark.multiproc
def test_failed_rank_is_named(make_cfg, tmp_path):
    # Damaged checkpoints are only found inside the ranks, when they resume: the parent reports which rank failed.
    from hpctrain.storage import checkpoint

    run = str(tmp_path / "run")
    train(make_cfg(*LAYOUT_RUN, "train.max_steps=2"), run)
    for ck in checkpoint.complete_checkpoints(run):
        with open(os.path.join(ck, checkpoint.STATE_FILE), "w") as f:
            f.write("{not json")
    with pytest.raises(TrainingError, match=r"rank \d of 2 failed \(exit code 1\)"):
        train(make_cfg(*LAYOUT_RUN, "parallel=tp2", "train.max_steps=4"), run)


@pytest.mark.multiproc
@pytest.mark.slow
def test_torchrun(make_cfg, demo_data, tmp_path):
    """A real torchrun: each process is a rank; dp=auto takes the world size."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run_dir = tmp_path / "tr"
    p = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "hpctrain",
                        *cli_args(run_dir, demo_data, "parallel=fsdp", "train.max_steps=3", "train.ckpt_every=0")],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(run_dir / "result.json") as f:
        assert json.load(f)["world"] == 2
    dloss, dnorm = deltas(reference(make_cfg, tmp_path), step_metrics(run_dir))
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


def test_ranks_are_told_apart_by_fork_order_across_the_pid_wrap():
    """The dead/stalled-rank and straggler tests kill or throttle a rank found by its PID: forked in rank order, and
    the order holds where PIDs wrap at pid_max (sorting alone would name rank 2 as rank 0)."""
    assert fork_order([7012, 7010, 7011], 32768) == [7010, 7011, 7012]
    assert fork_order([5, 32766, 300, 32760], 32768) == [32760, 32766, 5, 300]
    assert fork_order([], 32768) == []


def _start_and_wait_for_training(demo_data, run_dir, *extra) -> tuple[Forked, list[int]]:
    proc = Forked(cli.main, cli_args(run_dir, demo_data, *extra), run_dir.parent)
    try:
        # A logged step: every rank has joined its collectives, so every rank's hang watchdog is running.
        metrics = run_dir / "metrics.jsonl"
        until("a logged step", lambda: proc.poll() is not None or (
            metrics.exists() and '"step"' in metrics.read_text()), 240, every=0.05)  # (240 s: on a busy machine)
        assert proc.poll() is None, proc.err[-3000:]
    except BaseException:  # no run left behind
        proc.close()
        raise
    return proc, ranks_of(proc.pid)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_dead_or_stalled_rank_fails_the_job_fast(demo_data, tmp_path, how):
    """SIGKILL one rank: the launcher names it at once. SIGSTOP one: the others' sub-group collectives time out after
    cluster.pg_timeout_s and the job exits non-zero, with one line naming the stopped rank and its node, and every
    other rank's Python stacks in <run_dir>/hang/ (hang forensics, written before the collectives time out)."""
    timeout = 8
    layout = ["parallel=ddp", "parallel.dp=2"] if how == "dies" else ["parallel=dp2_tp2"]
    proc, ranks = _start_and_wait_for_training(demo_data, tmp_path / "run", *layout, "train.max_steps=100000",
                                               "train.ckpt_every=0", f"cluster.pg_timeout_s={timeout}",
                                               "monitor.heartbeat_s=1")
    victim = len(ranks) - 1
    t0 = time.time()
    with proc:  # (killed if it outlives the test)
        os.kill(ranks[victim], signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        _, err = proc.communicate(timeout=timeout + 60)
    took = time.time() - t0
    assert proc.returncode != 0
    assert took < timeout + 60, took  # (loose: the suite's cores are shared; the run alone never ends)
    if how == "dies":
        assert f"rank {victim} of 2 failed (killed by SIGKILL)" in err, err[-2000:]
    else:
        from hpctrain.parallel.process_group import node_name

        # (the one error line: another rank's log line of the same hang may come first)
        line = next((x for x in err.splitlines() if "stopped responding" in x and "of 4 failed" in x), err[-3000:])
        print(line)
        # (A rank stopped before its first heartbeat, while the run was being built, is named as such.)
        assert "of 4 failed" in line and (f"rank {victim} (node {node_name()}, last heartbeat " in line
                                          or f"rank {victim} (never sent a heartbeat) stopped responding" in line), line
        assert "(monitor.hang_s=7.2) on rank" in line or "a collective timed out in step" in line, line
        hang = tmp_path / "run" / "hang"
        assert sorted(os.listdir(hang)) == [f"rank-{r}.txt" for r in range(4) if r != victim], err[-2000:]
        for r in range(3):
            stacks = (hang / f"rank-{r}.txt").read_text()
            assert f"rank {victim} (" in stacks and "Thread MainThread" in stacks, stacks
            assert "hpctrain/training/trainer.py" in stacks and "hpctrain-hangwatch" in stacks, stacks


def _grad_bytes_mid_accumulation(cfg, sharded: bool, out: str) -> None:
    """One step of three micro-batches on this rank (ZeRO-2 over dp=2, or tp=2); write the most gradient bytes held
    whenever the step fetches a micro-batch (between backwards) and the parameters' own bytes."""
    import torch

    from hpctrain.parallel import process_group
    from hpctrain.parallel.layout import Layout
    from hpctrain.training.optimizer import build_optimizer
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import build_train_step

    env = process_group.init(60.0)
    layout = Layout(dp=cfg.parallel.dp, tp=cfg.parallel.tp)
    mesh = layout.build_mesh(env.device.type, 60.0)
    model = model_on(cfg, layout, mesh, env.device)
    step = build_train_step(model, build_optimizer(model, cfg.optim, 1e-3), setup_precision(cfg.precision, env.device),
                            env.device, mesh, layout, grad_clip=1.0, reduce_every_microbatch=sharded)
    held = []

    def micro_batches():
        g = torch.Generator().manual_seed(env.rank)
        for _ in range(3):
            held.append(held_grad_bytes(model))
            yield torch.randint(0, cfg.model.vocab_size, (2, 65), generator=g)

    step(micro_batches(), n_tokens=2 * 3 * 2 * 64)
    full = sum(p.numel() * 4 for p in model.parameters())  # a DTensor's numel() is the whole parameter's
    with open(f"{out}.{env.rank}", "w") as f:
        f.write(f"{max(held)} {full}")
    process_group.shutdown()


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, sharded", [("zero2", True), ("zero2", False), ("tp2", True), ("dp2_tp2", False)],
                         ids=["sharded", "unsharded", "tp2", "dp2_tp2_unsharded"])
def test_accumulation_keeps_gradients_sharded(make_cfg, tmp_path, layout, sharded):
    """parallel.sharded_accumulation (the default) reduce-scatters after every micro-batch: between micro-batches
    a rank holds its 1/dp share of the fp32 gradients, not the whole of them; false holds the whole (and is the
    faster choice the planner counts). Under tensor parallelism a rank holds its 1/tp share, the vocabulary-sharded
    embedding's gradient too (its backward gives the whole table: 0.6 of the whole was held before it was cut, with
    FSDP's unsharded accumulation too)."""
    from hpctrain.runtime.spawn import spawn

    cfg = make_cfg(f"parallel={layout}", "parallel.dp=1" if layout == "tp2" else "parallel.dp=2",
                   "model.tie_embeddings=false")
    out = str(tmp_path / "held")
    spawn(cfg.parallel.dp * cfg.parallel.tp, _grad_bytes_mid_accumulation, (cfg, sharded, out), threads=1)
    want = (1 / cfg.parallel.dp if sharded else 1) / cfg.parallel.tp
    for rank in range(cfg.parallel.dp * cfg.parallel.tp):
        held, full = map(int, read(f"{out}.{rank}").split())
        share = held / full
        assert want - 0.05 <= share <= want + 0.05, (rank, held, full)


def _init_state(cfg, layout, out: str) -> None:
    """Build the run's model on `layout` and write this rank's parameters, gathered whole, to out.<rank>."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpctrain.parallel import process_group

    env = process_group.init(60.0)
    mesh = layout.build_mesh(env.device.type, 60.0)
    model = model_on(cfg, layout, mesh, env.device)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save({k: v.detach().clone() for k, v in state.items()}, f"{out}.{env.rank}")
    # Under pp2 nothing above waits for the other stage: rank 0 (the store's host) could exit while rank 1 still
    # creates its own mesh groups through the store ("Connection reset by peer", once in a full suite)
    torch.distributed.barrier()
    process_group.shutdown()


@pytest.mark.multiproc
@pytest.mark.parametrize("overrides", [
    ["parallel=dp2_tp2"],  # ZeRO-3 over TP + SP: strided shards on dim 0, row-parallel shards on dim 1
    ["parallel=pp2", "model.n_layers=4", "model.tie_embeddings=false"],
    ["parallel=pp2", "model.n_layers=4", "model.tie_embeddings=true"],  # the head on stage 1 drawn as the table
    ["parallel=tp2", "model.tie_embeddings=true"],
    ["parallel=fsdp", "parallel.dp=4", "parallel.activation_checkpointing=full"],  # uneven shards, wrapped names
    ["parallel=dp2_tp2", "model.family=qwen3", "model.head_dim=32"],  # q/k norms: ones, over tp's heads
    ["parallel=tp2", "model.family=qwen2"],  # q/k/v biases: zeros, column-sharded
], ids=["dp2_tp2", "pp2", "pp2_tied", "tp2_tied", "dp4_ac", "dp2_tp2_qwen3", "tp2_qwen2"])
def test_sharded_init_equals_one_process(make_cfg, tmp_path, overrides):
    """Every rank draws only its shards, and the whole is bit-identical to one process's initialisation."""
    import torch

    from hpctrain.runs.resolve import resolve
    from hpctrain.runtime.spawn import spawn

    cfg = make_cfg(*overrides, "train.micro_batch=2", "train.grad_accum=null")
    layout = resolve(cfg, 4 if "dp2_tp2" in overrides[0] or "dp=4" in " ".join(overrides) else 2).layout
    spawn(layout.world, _init_state, (cfg, layout, str(tmp_path / "w")), threads=1)
    got = {}
    for rank in range(layout.world):
        got.update(torch.load(tmp_path / f"w.{rank}", weights_only=True))
    one = make_cfg(*[o for o in overrides if o.startswith("model.")])
    spawn(1, _init_state, (one, resolve(one, 1).layout, str(tmp_path / "one")), threads=1)
    want = torch.load(tmp_path / "one.0", weights_only=True)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _startup_excess(cfg, small, layout, out: str) -> None:
    """This rank's peak memory over its starting point while the model is built and initialised, read by the run's
    own probe. The small model is built first on the same mesh, so that the imports, the process group and the
    first DTensor dispatches, whose cost varies with the machine and with what the parent process did before
    (60-75 MB more in a CI run than here), are paid before the probe starts."""
    import gc

    import torch

    from hpctrain.monitoring.memory import MemoryProbe
    from hpctrain.parallel import process_group

    env = process_group.init(120.0)
    mesh = layout.build_mesh(env.device.type, 120.0)
    model_on(small, layout, mesh, env.device)
    gc.collect()
    probe = MemoryProbe(torch.device("cpu"))  # the host's resident peak, where a GPU rank would hold a copy too
    model_on(cfg, layout, mesh, env.device)
    with open(f"{out}.{env.rank}", "w") as f:
        f.write(str(probe.peak()))
    process_group.shutdown()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_startup_peak_is_even_across_ranks(make_cfg, tmp_path, dp):
    """llama_350m under fsdp: rank 0 holds no full copy any more; every rank's start-up peak is about its shard."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import num_params
    from hpctrain.runs.resolve import resolve
    from hpctrain.runtime.spawn import spawn

    shape = ("parallel=fsdp", f"parallel.dp={dp}", "train.micro_batch=1", "train.grad_accum=null",
             "train.global_batch=8")
    cfg = make_cfg("model=llama_350m", *shape, small_model=False)
    spawn(dp, _startup_excess, (cfg, make_cfg(*shape), resolve(cfg, dp).layout, str(tmp_path / "peak")), threads=1)
    excess = [int(read(tmp_path / f"peak.{rank}")) for rank in range(dp)]
    full = num_params(model_args(cfg.model)) * 4
    assert excess[0] <= 1.15 * excess[1], excess
    # Its fp32 shard, a 16 MiB init chunk, and slack (measured here: 15-40 MB over the shard at dp=2, 54 at dp=4); a
    # full copy would be 1.3 GB more.
    assert max(excess) < full / dp + 128 * 2**20, (excess, full)


def _weights_alive_after_forward(cfg, lean: bool, out: str) -> None:
    """Forward one micro-batch under bf16 on fsdp dp=2 and write the most bytes of parameter copies alive at any
    block's start and at the end of forward: the unsharded parameters FSDP holds plus the casts of parameters
    made during forward that still exist (what autocast's weight cache keeps). `lean`: FSDP gathers bf16
    parameters (the run's way); else fp32 ones that autocast casts (the old way), a control that the
    measurement sees a whole copy."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpctrain.models import spec_of
    from hpctrain.parallel import process_group
    from hpctrain.parallel.init import init_parameters
    from hpctrain.parallel.layout import Layout
    from hpctrain.parallel.parallelize import parallelize
    from hpctrain.training.precision import setup_precision

    env = process_group.init(60.0)
    layout, spec = Layout(dp=2), spec_of(cfg.model)
    mesh = layout.build_mesh(env.device.type, 60.0)
    args = spec.args(cfg.model)
    with torch.device("meta"):
        model = spec.build(args)
    model = parallelize(model, layout, mesh, cfg.parallel, spec, torch.bfloat16 if lean else None)
    model.to_empty(device=env.device)
    model.init_buffers()
    init_parameters(model, spec.init_rule(args), 0)
    casts: list = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter):
                casts.append(weakref.ref(result))
            return result

    alive = []

    def measure(*_):
        held = sum(t.untyped_storage().nbytes() for ref in casts if (t := ref()) is not None)
        alive.append(held + fsdp_unsharded_bytes(model))

    for block in model.layers.values():
        block.register_forward_pre_hook(measure)  # runs after FSDP's own: the block's parameters are gathered
    model.register_forward_hook(measure)
    precision = setup_precision(cfg.precision, env.device)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    with Casts(), precision.autocast():
        model(tokens).float().sum().backward()
    with open(f"{out}.{env.rank}", "w") as f:
        f.write(str(max(alive)))
    process_group.shutdown()


@pytest.mark.multiproc
def test_bf16_fsdp_keeps_no_whole_copy_alive_in_forward(make_cfg, tmp_path):
    """bf16 under FSDP gathers bf16 parameters and frees each block's after its forward: during forward at most the
    root unit (embedding, norm, head) and ~2 blocks' worth of parameter copies are alive, where autocast's weight
    cache kept the whole model."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import num_params
    from hpctrain.runtime.spawn import spawn

    cfg = make_cfg("parallel=fsdp", "parallel.dp=2", "precision=bf16", "model.n_layers=8", "model.dim=256",
                   "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden=688", "model.tie_embeddings=false")
    args = model_args(cfg.model)
    root = (2 * args.vocab_size * args.dim + args.dim) * 2  # bf16 bytes of embedding, head and final norm
    block = (num_params(args) * 2 - root) // args.n_layers
    measured = {}
    for lean in (True, False):
        spawn(2, _weights_alive_after_forward, (cfg, lean, str(tmp_path / f"alive-{lean}")), threads=1)
        measured[lean] = [int(read(tmp_path / f"alive-{lean}.{rank}")) for rank in range(2)]
    print(f"parameter copies alive in forward, most: {measured} bytes per rank; a block {block}, the root {root}")
    assert max(measured[True]) <= root + 2 * block, (measured, block)
    assert min(measured[False]) >= args.n_layers * block, (measured, block)  # the control sees the whole copy


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel=fsdp", "parallel.dp=2"], ["parallel=dp2_tp2"]], ids=["fsdp", "dp2_tp2"])
def test_evaluation_is_split_over_data_parallel_ranks(make_cfg, tmp_path, layout):
    """Each dp rank evaluates its share of train.eval_batches global batches: the validation loss equals one
    process's over the same samples (to 1e-6), and each rank ran half of the micro-batches."""
    import torch

    from hpctrain.core.files import read_metrics
    from hpctrain.runs.resolve import resolve
    from hpctrain.training.feed import ValSplit, eval_microbatches
    from hpctrain.training.run import train

    ev = ("train.eval_every=2", "train.eval_batches=3", "train.max_steps=2", "train.global_batch=8",
          "train.micro_batch=2", "train.grad_accum=null", "train.ckpt_every=0", "logging.trackers=[]",
          "cluster.num_threads=1")
    vals = {}
    for name, extra in (("one", []), ("split", layout)):
        cfg = make_cfg(*ev, *extra)
        assert train(cfg, str(tmp_path / name))["status"] == "completed"
        vals[name] = [r["val_loss"] for r in read_metrics(str(tmp_path / name)) if "val_loss" in r]
    assert len(vals["one"]) == len(vals["split"]) == 1
    assert abs(vals["one"][0] - vals["split"][0]) <= 1e-6, vals
    # The shares: 3 global batches of 8 = 12 micro-batches of 2, alternating between the two dp ranks.
    cfg = make_cfg(*ev, *layout)
    shape = resolve(cfg, 4 if "dp2_tp2" in layout[0] else 2)
    data = cfg.data.path
    shares = [list(ValSplit.of(data, shape, cfg.data, cfg.train).share(r)) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 6 == eval_microbatches(10**6, 3, shape) // 2
    one = list(ValSplit.of(data, resolve(make_cfg(*ev), 1), cfg.data, cfg.train).share(0))
    assert torch.equal(torch.cat(one[0::2]), torch.cat(shares[0])) and torch.equal(torch.cat(one[1::2]),
                                                                                   torch.cat(shares[1]))


def _agreed_overflow(out: str) -> None:
    """Rank 0's gradient overflows, rank 1's does not: both must skip the step and back off alike."""
    import torch

    from hpctrain.parallel import process_group
    from hpctrain.training.precision import AgreedGradScaler

    env = process_group.init(60.0)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = AgreedGradScaler("cpu", init_scale=1024.0)
    scaler.scale(p.sum()).backward()
    if env.rank == 0:
        p.grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    with open(f"{out}.{env.rank}", "w") as f:
        f.write(f"{scaler.get_scale()} {p.detach().tolist()}")
    process_group.shutdown()


@pytest.mark.multiproc
def test_fp16_overflow_is_agreed_by_every_rank(tmp_path):
    from hpctrain.runtime.spawn import spawn

    spawn(2, _agreed_overflow, (str(tmp_path / "r"),), threads=1)
    assert read(tmp_path / "r.0") == read(tmp_path / "r.1") == "512.0 [1.0, 1.0, 1.0, 1.0]"


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel=fsdp", "parallel.dp=2"], ["parallel=tp2"], ["parallel=dp2_tp2"],
                                    ["parallel=pp2"]], ids=["fsdp", "tp2", "dp2_tp2", "pp2"])
def test_fp16_in_several_processes_tracks_one_process(make_cfg, tmp_path, layout):
    """precision=fp16 with one loss scale for all ranks: every step overflowing from a huge initial scale is skipped
    on every rank as in one process (same losses, same scales), then, from a workable scale, the run tracks
    one-process fp16 (pp2: with the tied embedding's two copies)."""
    for init, tol in ((2.0**40, 1e-5), (2.0**16, 2e-3)):
        fp16 = ("precision=fp16", f"precision.loss_scale_init={init}")
        ref, logged = reference(make_cfg, tmp_path, *fp16, logged=True)  # (shared by the four layouts)
        got = run_layout(make_cfg, tmp_path / f"got-{init}", *fp16, *layout)
        scales = [[r["loss_scale"] for r in run if "loss" in r] for run in (logged, records(tmp_path / f"got-{init}"))]
        assert scales[0] == scales[1], scales
        assert max(abs(ref[s][0] - got[s][0]) for s in ref) <= tol, (init, ref, got)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel=ddp", "parallel.dp=2"], ["parallel=tp2"]], ids=["ddp", "tp2"])
def test_sgd_over_dtensor_parameters_equals_one_process(make_cfg, tmp_path, layout):
    """optim=sgd's fused kernel has no DTensor sharding rule in torch 2.13 (the step crashed): dp and tp layouts run
    its foreach kernels, with one process's (fused) losses."""
    ref = reference(make_cfg, tmp_path, "optim=sgd")
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / "got", "optim=sgd", *layout))
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)
