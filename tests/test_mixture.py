"""Training mixtures (data.sources): exact proportions in every prefix, one global sequence whatever the layout, exact
resume, refused mixtures — on real shard sets built by the test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpctrain.core.shard_format import DataError, read_manifest
from hpctrain.data.loader import ShardStream
from hpctrain.data.mixture import MixtureStream, Source, lane_counts, period

WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Source]:
    """Three shard sets of one tokenizer, of different sizes (8 shards each, 64-token blocks)."""
    from data_prep.synthetic import build_synthetic

    out = []
    for i, (name, weight) in enumerate(WEIGHTS.items()):
        path = str(tmp_path_factory.mktemp(name))
        build_synthetic(path, 512, 64, samples=48 + 24 * i, val_samples=8, shards=8, seed=i)
        out.append(Source(name, path, weight))
    return out


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.37, 0.05, 0.58], [1, 1, 1], [3, 1]])
def test_every_prefix_holds_each_source_within_one_sample(weights):
    cycle = period(weights)
    share = np.array(weights, dtype=float) / sum(weights)
    counts = np.zeros(len(weights))
    for g in range(3 * len(cycle) + 7):
        counts[cycle[g % len(cycle)]] += 1
        assert np.all(np.abs(counts - share * (g + 1)) < 1), (g, counts, share * (g + 1))
    for g in (0, 1, 17, 1000, 123457):  # the closed form the resumed streams use, against counting
        direct = np.bincount(cycle[np.arange(g) % len(cycle)], minlength=len(weights))
        assert (lane_counts(cycle, len(weights), 4, g).sum(axis=1) == direct).all()


def _global(stream_of, dp: int, n: int) -> torch.Tensor:
    """The first n global samples, rebuilt from the dp ranks' streams (rank r holds g ≡ r mod dp)."""
    its = [iter(stream_of(r)) for r in range(dp)]
    out = []
    while len(out) < n:
        batches = [next(it) for it in its]
        out += [batches[r][i] for i in range(len(batches[0])) for r in range(dp)]
    return torch.stack(out[:n])


def test_one_global_sequence_at_any_dp_drawn_from_each_sources_own_stream(sources):
    """dp 1, 2 and 4 give the same global samples; sample g is the next unread sample of source src(g)'s lane
    g % lanes in that source's own stream (the shuffled order of one shard set, as ShardStream reads it)."""
    lanes, n = 4, 160

    def mix(dp, start=0):
        return lambda r: MixtureStream(sources, "train", 2, 7, start_sample=start, lanes=lanes, dp_rank=r,
                                       dp_size=dp)

    one = _global(mix(1), 1, n)
    for dp in (2, 4):
        assert torch.equal(_global(mix(dp), dp, n), one), dp
    cycle = period([s.weight for s in sources])
    own = [_global(lambda r, s=s: ShardStream(s.path, "train", 1, 7, lanes=lanes), 1, 200) for s in sources]
    taken = np.zeros((len(sources), lanes), dtype=int)
    for g in range(n):
        s, lane = cycle[g % len(cycle)], g % lanes
        assert torch.equal(one[g], own[s][taken[s, lane] * lanes + lane]), g
        taken[s, lane] += 1
    assert taken.sum(axis=1).tolist() == [80, 48, 32]  # 0.5 / 0.3 / 0.2 of 160
    # A stream started mid-mixture (a resumed run), on another dp, yields exactly the tail: the smallest source has
    # crossed into its next, reshuffled epoch by then.
    assert torch.equal(_global(mix(2, start=64), 2, n - 64), one[64:])


def test_a_schedule_switch_continues_every_source_from_its_own_position(sources):
    """From global sample 80 on, weights 0 / 0.5 / 0.5 (an annealing phase without `web`): each source's next
    sample after the switch is the next of its own stream, the new phase is exact in its own prefixes, and the
    sequence is the same at dp 1 and 4 and from a start past the switch."""
    from hpctrain.data.mixture import Schedule

    lanes, n, switch = 4, 160, 80
    phases = [(switch, [0.0, 0.5, 0.5])]

    def mix(dp, start=0):
        return lambda r: MixtureStream(sources, "train", 2, 7, start_sample=start, lanes=lanes, dp_rank=r,
                                       dp_size=dp, schedule=phases)

    one = _global(mix(1), 1, n)
    assert torch.equal(_global(mix(4), 4, n), one) and torch.equal(_global(mix(2, start=96), 2, n - 96), one[96:])
    plan = Schedule([(0, [s.weight for s in sources]), *phases])
    src = plan.source(np.arange(n))
    assert np.bincount(src[:switch], minlength=3).tolist() == [40, 24, 16]
    assert np.bincount(src[switch:], minlength=3).tolist() == [0, 40, 40]
    own = [_global(lambda r, s=s: ShardStream(s.path, "train", 1, 7, lanes=lanes), 1, 200) for s in sources]
    taken = np.zeros((3, lanes), dtype=int)
    for g in range(n):
        s, lane = src[g], g % lanes
        assert torch.equal(one[g], own[s][taken[s, lane] * lanes + lane]), g
        taken[s, lane] += 1
    assert (plan.counts(3, lanes, n) == taken).all()


def test_mixtures_that_cannot_be_mixed_are_one_line(sources, tmp_path):
    from data_prep.synthetic import build_synthetic

    other = str(tmp_path / "other")
    build_synthetic(other, 600, 64, samples=48, shards=8)  # another vocabulary: another tokenizer
    shorter = str(tmp_path / "shorter")
    build_synthetic(shorter, 512, 32, samples=48, shards=8)
    few = str(tmp_path / "few")
    build_synthetic(few, 512, 64, samples=2, shards=1)  # (two one-sample shards: fewer than 4 lanes)
    for bad, words in (([*sources[:2], Source("other", other, 0.5)], "was tokenised with another tokenizer"),
                       ([*sources[:2], Source("shorter", shorter, 0.5)], "holds 33-token blocks"),
                       ([sources[0], Source("web", sources[1].path, 0.5)], "repeat: give each source its own name"),
                       ([*sources[:2], Source("few", few, 0.5)], "every source is read through all lanes"),
                       ([sources[0], Source("x", sources[1].path, 0.3333333)], "round them to fewer decimals"),
                       ([sources[0], Source("x", sources[1].path, -1)], "every weight must be >= 0 and one > 0")):
        with pytest.raises(DataError) as e:
            MixtureStream(bad, "train", 2, 7, lanes=4)
        assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))


def _cfg(make_cfg, sources, *overrides):
    listed = ",".join(f"{{name:{s.name},path:{s.path},weight:{s.weight}}}" for s in sources)
    return make_cfg(f"data.path={sources[0].path}", f"data.sources=[{listed}]", "train.global_batch=8",
                    "train.micro_batch=2", "train.grad_accum=null", "train.eval_every=0", "logging.trackers=[]",
                    "cluster.num_threads=1", "train.log_every=1", "train.ckpt_every=3", *overrides)


@pytest.mark.multiproc
def test_a_mixed_run_resumed_on_another_dp_equals_the_uninterrupted_one(make_cfg, sources, tmp_path):
    """Six steps in one process, against three steps then three more resumed as fsdp dp=2: the same losses (the
    mixture continues every source from its own position); a changed mixture is refused on resume."""
    from hpctrain.core.files import read_metrics
    from hpctrain.training.run import TrainingError, prepare, train

    def losses(run_dir):
        return {m["step"]: m["loss"] for m in read_metrics(str(run_dir)) if "loss" in m and "step" in m}

    assert train(_cfg(make_cfg, sources, "train.max_steps=6"), str(tmp_path / "one"))["status"] == "completed"
    assert train(_cfg(make_cfg, sources, "train.max_steps=3"), str(tmp_path / "cut"))["status"] == "completed"
    resumed = _cfg(make_cfg, sources, "train.max_steps=6", "parallel=fsdp", "parallel.dp=2")
    assert train(resumed, str(tmp_path / "cut"))["status"] == "completed"
    want, got = losses(tmp_path / "one"), losses(tmp_path / "cut")
    assert sorted(got) == list(range(1, 7)) and all(abs(got[k] - want[k]) <= 1e-5 for k in want), (got, want)
    records = [m for m in read_metrics(str(tmp_path / "one")) if "loss" in m and "step" in m]
    _check_source_losses(records, [m for m in read_metrics(str(tmp_path / "cut")) if "loss" in m and "step" in m])
    assert records[-1]["data_samples/web"] + records[-1]["data_samples/code"] + records[-1]["data_samples/math"] == 48
    per_epoch = read_manifest(sources[0].path).num_samples("train")
    assert records[-1]["data_samples/web"] == 24 and records[-1]["data_epochs/web"] == round(24 / per_epoch, 4)
    changed = [Source(s.name, s.path, w) for s, w in zip(sources, (0.2, 0.3, 0.5))]
    with pytest.raises(TrainingError, match="data.sources=.* but this run was trained with data.sources="):
        train(_cfg(make_cfg, changed, "train.max_steps=8"), str(tmp_path / "cut"))
    from data_prep.synthetic import build_synthetic

    build_synthetic(str(tmp_path / "val"), 500, 64, samples=48, shards=8)  # (a tokenizer of 500 tokens)
    with pytest.raises(DataError, match="another tokenizer than 'data.path'"):  # before anything is spawned
        prepare(_cfg(make_cfg, sources, f"data.path={tmp_path / 'val'}"))


def _check_source_losses(want: list[dict], got: list[dict]) -> None:
    """loss/<source> at each logged step (log_every=1): the sources' losses weighted by their tokens in the step make
    the step's loss, and another layout's run logs the same ones."""
    names = [k[len("loss/"):] for k in want[0] if k.startswith("loss/")]
    assert sorted(names) == sorted(WEIGHTS), want[0]
    before = dict.fromkeys(names, 0)
    for record, other in zip(want, got, strict=True):
        tokens = {n: record[f"data_tokens/{n}"] - before[n] for n in names}
        assert sum(record[f"loss/{n}"] * tokens[n] for n in names) / sum(tokens.values()) == pytest.approx(
            record["loss"], rel=1e-6)
        assert all(abs(record[f"loss/{n}"] - other[f"loss/{n}"]) <= 1e-5 for n in names), (record, other)
        before = {n: record[f"data_tokens/{n}"] for n in names}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["parallel=pp2", "parallel=tp2"])
def test_each_sources_loss_in_a_pipeline_and_with_loss_parallel(make_cfg, sources, tmp_path, layout):
    """loss/<source> of a pipeline (the last stage's per-sample losses, summed over stages) and of vocabulary-sharded
    logits (loss parallel): those of one process."""
    from hpctrain.core.files import read_metrics
    from hpctrain.training.run import train

    runs = {}
    for name, extra in (("one", []), ("layout", [layout])):
        cfg = _cfg(make_cfg, sources, "train.max_steps=3", "model.tie_embeddings=false", *extra)
        assert train(cfg, str(tmp_path / name))["status"] == "completed"
        runs[name] = [m for m in read_metrics(str(tmp_path / name)) if "loss" in m and "step" in m]
    _check_source_losses(runs["one"], runs["layout"])


@pytest.mark.multiproc
def test_a_schedule_resumed_on_another_dp_and_changed_only_in_its_future(make_cfg, sources, tmp_path):
    """data.schedule switching at step 4: stopped at step 3 and resumed as fsdp dp=2, the losses of the
    uninterrupted run; a phase not yet begun may change on resume, one already begun may not (one line)."""
    from hpctrain.core.files import read_metrics
    from hpctrain.training.run import TrainingError, train

    anneal = "data.schedule=[{step:4,weights:{code:0.5,math:0.5}}]"

    def losses(run_dir):
        return {m["step"]: m["loss"] for m in read_metrics(str(run_dir)) if "loss" in m and "step" in m}

    assert train(_cfg(make_cfg, sources, anneal, "train.max_steps=6"), str(tmp_path / "one"))["status"] == "completed"
    assert train(_cfg(make_cfg, sources, anneal, "train.max_steps=3"), str(tmp_path / "cut"))["status"] == "completed"
    resumed = _cfg(make_cfg, sources, anneal, "train.max_steps=6", "parallel=fsdp", "parallel.dp=2")
    assert train(resumed, str(tmp_path / "cut"))["status"] == "completed"
    want, got = losses(tmp_path / "one"), losses(tmp_path / "cut")
    assert sorted(got) == list(range(1, 7)) and all(abs(got[k] - want[k]) <= 1e-5 for k in want), (got, want)
    last = [m for m in read_metrics(str(tmp_path / "one")) if "loss" in m and "step" in m][-1]
    assert last["data_samples/web"] == 12  # 0.5 of the first 3 steps' 24 samples, none after the switch
    later = "data.schedule=[{step:4,weights:{code:0.5,math:0.5}},{step:8,weights:{math:1}}]"
    assert train(_cfg(make_cfg, sources, later, "train.max_steps=7"), str(tmp_path / "cut"))["status"] == "completed"
    with pytest.raises(TrainingError, match="data.schedule=.* but this run was trained with data.schedule="):
        train(_cfg(make_cfg, sources, "data.schedule=[{step:5,weights:{math:1}}]", "train.max_steps=9"),
              str(tmp_path / "cut"))


def test_a_source_that_would_repeat_too_often_is_refused_or_warned(make_cfg, sources):
    import logging

    from hpctrain.training.run import prepare

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())

    cfg = _cfg(make_cfg, sources, "train.max_steps=20", "data.max_epochs=1.5")  # web: 80 of 160 samples, 49 an epoch
    with pytest.raises(DataError, match=r"source 'web' .* would give 1.63 epochs over train.max_steps=20 "
                                        r"\(data.max_epochs=1.5\)"):
        prepare(cfg)
    logging.getLogger("hpctrain").addHandler(handler)
    try:
        prepare(_cfg(make_cfg, sources, "train.max_steps=20", "data.max_epochs=1.5", "data.on_max_epochs=warn"))
    finally:
        logging.getLogger("hpctrain").removeHandler(handler)
    assert any("would give 1.63 epochs" in w for w in warned), warned
    with pytest.raises(DataError, match=r"data.schedule at step 4 names \['nope'\], not among data.sources"):
        prepare(_cfg(make_cfg, sources, "data.schedule=[{step:4,weights:{nope:1}}]"))


def test_each_source_is_evaluated_on_its_own_validation_split(make_cfg, sources, tmp_path):
    """val_loss/<source> for every source at each evaluation; the source whose shards are data.path's scores what
    val_loss does (the same split, the same samples), the others their own."""
    from hpctrain.core.files import read_metrics
    from hpctrain.training.run import train

    cfg = _cfg(make_cfg, sources, "train.max_steps=3", "train.eval_every=3", "train.eval_batches=1")
    assert train(cfg, str(tmp_path / "run"))["status"] == "completed"
    (val,) = [m for m in read_metrics(str(tmp_path / "run")) if "val_loss" in m]
    assert val["val_loss/web"] == val["val_loss"], val
    assert len({val["val_loss/web"], val["val_loss/code"], val["val_loss/math"]}) == 3, val
    from hpctrain.launch.sweep import format_table, report

    table = format_table(report(str(tmp_path / "run")))  # the sweep report shows them too
    assert "val by source" in table and f"web {val['val_loss/web']:.4f} code {val['val_loss/code']:.4f}" in table, table
    last = [m for m in read_metrics(str(tmp_path / "run")) if "loss" in m][-1]
    assert "loss by source" in table and f"web {last['loss/web']:.4f} code {last['loss/code']:.4f}" in table, table


def test_plan_prints_the_mixture(sources, tmp_path):
    """`hpctrain plan` with data.sources: each source's samples, tokens and epochs over train.max_steps, and the
    schedule's phases."""
    from helpers import run_forked

    from hpctrain import cli

    listed = ",".join(f"{{name:{s.name},path:{s.path},weight:{s.weight}}}" for s in sources)
    p = run_forked(cli.main, ["plan", f"data.path={sources[0].path}", f"data.sources=[{listed}]",
                              "data.schedule=[{step:11,weights:{math:1}}]", "train.max_steps=20",
                              "train.global_batch=8", "train.micro_batch=2", "train.seq_len=64"], cwd=tmp_path)
    assert p.code == 0, p.err
    assert "data mixture over train.max_steps=20 (160 samples of 64 tokens):" in p.out, p.out
    per_epoch = read_manifest(sources[0].path).num_samples("train")
    assert f"web          weight 0.5: 40 samples, 0.0000B tokens, {40 / per_epoch:.2f} epochs of its {per_epoch}" in p.out
    assert "math         weight 0.2: 96 samples" in p.out and "from step 11: web 0, code 0, math 1" in p.out, p.out
