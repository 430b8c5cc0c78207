"""Context parallelism (parallel.cp): each sequence split over ranks in the zig-zag layout, attention over all-gathered
keys and values; every layout trains the losses and gradient norms of one process at 4096 tokens."""

import pytest
import torch
from conftest import SMALL_MODEL
from helpers import deltas, one_line, run_layout

from hpctrain.parallel.context import attention_pairs, zigzag_index

# A model narrow enough that 4096² attention stays quick (GQA: 4 heads, 2 kv); 4096-token blocks of ~700-token
# documents (a document spans cp chunks, so the masks meet across ranks).
LONG_KW = dict(vocab_size=512, seq_len=4096, samples=8, shards=2, doc_tokens=700)
LONG = (*SMALL_MODEL, "model.dim=32", "model.ffn_hidden=64", "model.max_seq_len=4096", "train.global_batch=2",
        "train.micro_batch=1", "data.lanes=2")
LAYOUTS = {"cp2": ["parallel.cp=2"],
           "cp4_fused": ["parallel.cp=4", "train.fused_loss=true"],
           "cp2_docs_restart": ["parallel.cp=2", "train.document_mask=true", "train.restart_positions=true"],
           "cp4_docs_restart": ["parallel.cp=4", "train.document_mask=true", "train.restart_positions=true"],
           "cp2_fsdp_dp2_ac": ["parallel=fsdp", "parallel.dp=2", "parallel.cp=2", "parallel.activation_checkpointing=full"],
           "cp2_tp2_sp": ["parallel=tp2_sp", "parallel.cp=2"],
           "cp2_pp2": ["parallel=pp2", "parallel.cp=2"]}
_refs: dict = {}


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> str:
    from data_prep.synthetic import build_synthetic

    out = str(tmp_path_factory.mktemp("long"))
    build_synthetic(out, **LONG_KW)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_zigzag_split_covers_each_sequence_once_with_equal_attention_work(cp):
    """Every position is held by one rank; each rank's causal query-key pairs are the same number (T(T+1)/2 over
    all), and so are the pairs its two chunk attentions compute (each query chunk over the keys up to its end)."""
    T, c = 48 * cp, 24
    held = [zigzag_index(T, cp, r) for r in range(cp)]
    assert torch.cat(held).sort().values.equal(torch.arange(T))
    causal = [int((idx + 1).sum()) for idx in held]  # query at position q attends keys 0..q
    assert len(set(causal)) == 1 and sum(causal) == T * (T + 1) // 2, causal
    computed = [sum((int(q) // c + 1) * c for q in idx) for idx in held]
    assert computed == [attention_pairs(T, cp, r) for r in range(cp)] and len(set(computed)) == 1, computed


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_the_losses_of_one_process(make_cfg, tmp_path, long_data, layout):
    """fp32, 3 steps of 2 sequences of 4096 tokens: cp=2 and cp=4 (with and without document masking and restarted
    positions, the fused loss), cp2 inside fsdp dp=2 with activation checkpointing, with tp2 + sequence parallel,
    and with pp2 equal one process. (Document masks with global positions: the same masks, the plain cases'
    positions; one masked reference saves a one-process run of 4096² attention.)"""
    key = "docs" if "train.document_mask=true" in LAYOUTS[layout] else "plain"
    if key not in _refs:
        extra = [o for o in LAYOUTS[layout] if o.startswith("train.")]
        _refs[key] = run_layout(make_cfg, tmp_path / "one", *LONG, f"data.path={long_data}", *extra)
    got = run_layout(make_cfg, tmp_path / layout, *LONG, f"data.path={long_data}", *LAYOUTS[layout])
    dloss, dnorm = deltas(_refs[key], got)
    print(f"cp {layout}: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
def test_a_checkpoint_written_at_cp2_resumes_at_cp1_as_if_uninterrupted(make_cfg, tmp_path):
    """cp does not place parameters, but FSDP shards them over dp×cp: 3 steps at cp=2 (ZeRO-3 over its 2 ranks),
    resumed for 3 more in one process, give the losses of 6 uninterrupted steps (the session's 64-token shards); the
    validation loss at step 3, each cp rank scoring its part of every sequence, is one process's too."""
    from helpers import losses, records

    from hpctrain.training.run import train

    def run(name, steps, *layout):
        cfg = make_cfg("train.micro_batch=2", f"train.max_steps={steps}", "train.eval_every=3",
                       "train.ckpt_every=3", "logging.trackers=[]", "optim.decay_steps=12", *layout)
        assert train(cfg, str(tmp_path / name))["status"] == "completed"

    def val(name) -> dict[int, float]:
        return {r["step"]: r["val_loss"] for r in records(tmp_path / name) if "val_loss" in r}

    run("whole", 6)
    run("resumed", 3, "parallel=fsdp", "parallel.dp=1", "parallel.cp=2")
    assert abs(val("whole")[3] - val("resumed")[3]) <= 1e-5, (val("whole"), val("resumed"))
    run("resumed", 6)
    whole, got = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert all(abs(whole[s] - got[s]) <= 1e-5 for s in (4, 5, 6)), (whole, got)


@pytest.mark.multiproc
def test_compiled_blocks_under_cp_equal_one_process(make_cfg, tmp_path, monkeypatch):
    """parallel.compile with cp: each block (its all-gathers and chunk attentions) traced whole (fullgraph, through
    AOT autograd), with activation checkpointing, on the session's 64-token shards, equals one process. The blocks
    go to the aot_eager backend: what cp adds is traced as inductor would be given it, without inductor's C++ builds
    in each rank (~40 s of the suite on 2 cores; its code generation is tested with the fused loss and the masked
    blocks)."""
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="aot_eager", **kw))
    ref = run_layout(make_cfg, tmp_path / "one", "train.micro_batch=2")
    got = run_layout(make_cfg, tmp_path / "cp2", "train.micro_batch=2", "parallel.cp=2", "parallel.compile=true",
                     "parallel.activation_checkpointing=full")
    dloss, dnorm = deltas(ref, got)
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.cp=2", "train.seq_len=62"], ("train.seq_len=62", "not divisible by 4", "multiple of 4")),
    (["parallel.cp=2", "parallel=tp2_sp", "train.seq_len=36"], ("train.seq_len=36", "divisible by 8")),
    (["parallel.cp=2", "model.rope_scaling.type=dynamic", "model.rope_scaling.original_max_seq_len=32"],
     ("parallel.cp=2", "dynamic", "cp=1")),
    (["parallel.cp=2", "optim=sophia"], ("parallel.cp=2", "sophia")),
    (["parallel.cp=0"], ("parallel.cp=0", ">= 1")),
    (["parallel.cp=2", "parallel=ddp", "parallel.dp=2", "parallel.grad_compression=topk"],
     ("parallel.cp=2", "grad_compression", "cp=1")),
])
def test_bad_cp_settings_are_one_line(make_cfg, overrides, words):
    from hpctrain.core.errors import ConfigError
    from hpctrain.parallel.layout import world_of
    from hpctrain.runs.resolve import resolve

    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world_of(cfg.parallel, 8))
    one_line(e.value, *words)


def test_the_plan_names_the_longest_sequence_that_fits_and_cp_lengthens_it(make_cfg):
    """`hpctrain plan` with cluster.gpu_mem_gb: the longest train.seq_len (a multiple of 2·cp) whose worst stage fits,
    and one step longer does not; more cp ranks per sequence, a longer one."""
    from hpctrain.parallel.layout import world_of
    from hpctrain.runs.resolve import resolve
    from hpctrain.training import planner

    longest = {}
    for cp in (1, 2, 4):
        cfg = make_cfg("model=llama_1b", "model.max_seq_len=524288", "train.seq_len=8192", "train.global_batch=1",
                       "train.micro_batch=1", "precision=bf16", "parallel=fsdp", "parallel.dp=1", f"parallel.cp={cp}",
                       "parallel.activation_checkpointing=full", "cluster.gpu_mem_gb=80", small_model=False)
        plan = resolve(cfg, world_of(cfg.parallel, 8))
        text, _ = planner.report(cfg, plan, 8192, [])
        line = next(x for x in text.splitlines() if x.startswith("longest train.seq_len"))
        longest[cp] = int(line.split(": ")[1].split()[0])
        stages, usable, unit = planner.estimate(cfg, plan, 8192)["stages"], 80 * planner.HEADROOM * planner.GiB, \
            2 * cp if cp > 1 else 1
        need = [max(planner.total(r, "full") for r in planner.estimate(cfg, plan, n, stages)["rows"])
                for n in (longest[cp], longest[cp] + unit)]
        assert longest[cp] % unit == 0 and need[0] <= usable < need[1], (cp, longest, need)
    assert longest[1] < longest[2] < longest[4], longest


def test_dp_auto_the_job_shape_and_the_messages_count_cp():
    from hpctrain.core.config import ClusterConfig, ConfigError, ParallelConfig
    from hpctrain.parallel.layout import Layout, job_shape, world_of

    p = ParallelConfig(dp="auto", cp=2, tp=2)
    layout = Layout.from_config(p, 8)
    assert (layout.dp, layout.cp, layout.world) == (2, 2, 8) and world_of(p, 8) == 8
    assert layout.describe() == "dp×cp×tp×pp=2×2×2×1"
    assert job_shape(p, ClusterConfig(nodes=2, gpus_per_node=4)) == {"nodes": 2, "tasks_per_node": 4,
                                                                     "gpus_per_node": 4}
    with pytest.raises(ConfigError) as e:
        Layout.from_config(ParallelConfig(dp="auto", cp=3), 8)
    one_line(e.value, "dp=auto", "tp×pp×cp=1×1×3")
