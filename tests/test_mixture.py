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


def _copy(source: Source, to, edit=None) -> str:
    """A copy of `source`'s shard set at `to`, its manifest.json edited by `edit(doc)` (given)."""
    import json
    import shutil

    shutil.copytree(source.path, to)
    if edit:
        doc = json.loads((to / "manifest.json").read_text())
        edit(doc)
        (to / "manifest.json").write_text(json.dumps(doc))
    return str(to)


def test_bad_sources_and_weights_are_one_line_before_anything_starts(make_cfg, sources, tmp_path):
    """Before any spawn (`prepare`), one line naming the fix: a source's train or val shard missing, a source with no
    train split or too few shards for dp, a weight that is not a number. data.path gives a mixture only its tokenizer
    and validation split: a train split smaller than the global batch is no reason to refuse one."""
    import os

    from hpctrain.training.run import prepare

    web, code, math = sources
    no_train = _copy(code, tmp_path / "no_train", lambda doc: doc["splits"].update(train=[]))
    one_shard = _copy(code, tmp_path / "one_shard", lambda doc: doc["splits"].update(train=doc["splits"]["train"][:1]))
    missing = {split: _copy(code, tmp_path / f"no_{split}_shard") for split in ("train", "val")}
    for split, path in missing.items():
        os.remove(os.path.join(path, read_manifest(path).shards(split)[-1].name))

    def refused(mixed, *overrides) -> str:
        with pytest.raises(DataError) as e:
            prepare(_cfg(make_cfg, mixed, *overrides))
        assert "\n" not in str(e.value), str(e.value)
        return str(e.value)

    assert f"shard {missing['train']}/train-" in refused([web, Source("code", missing["train"], 0.3), math])
    assert f"shard {missing['val']}/val-" in refused([web, Source("code", missing["val"], 0.3), math],
                                                    "train.eval_every=2")
    prepare(_cfg(make_cfg, [web, Source("code", missing["val"], 0.3), math]))  # (no evaluation: its val split unread)
    assert f"source 'code' ({no_train}) has no train samples" in refused([web, Source("code", no_train, 0.3), math])
    assert f"source 'code' ({one_shard}): dp=2 ranks need at least 2 non-empty train shards" in refused(
        [web, Source("code", one_shard, 0.3), math], "parallel=ddp", "parallel.dp=2")
    assert "mixture weights [0.5, nan, 0.2]: every weight must be >= 0 and one > 0, all finite" in refused(
        [web, Source("code", code.path, float("nan")), math])
    assert "data.schedule at step 3: weights {'web': 0.0, 'code': 0.0, 'math': inf}" in refused(
        sources, "data.schedule=[{step:3,weights:{math:inf}}]")
    small = _copy(code, tmp_path / "small", lambda doc: doc["splits"].update(train=doc["splits"]["train"][:1]))
    assert read_manifest(small).num_samples("train") < 8
    prepare(_cfg(make_cfg, sources, f"data.path={small}"))  # a global batch of 8 from the sources


def test_a_skipped_shard_of_a_source_is_named_in_a_warning(sources, tmp_path):
    """data.on_corrupt=skip in a mixture: the corrupt shard is replaced and a warning names it, as for one shard set."""
    import logging

    bad = _copy(sources[1], tmp_path / "bad")
    names = [s.name for s in read_manifest(bad).shards("train")[:10]]
    for name in names:
        with open(f"{bad}/{name}", "r+b") as f:
            f.write(b"not a tar")
    stream = MixtureStream([sources[0], Source("code", bad, 0.5)], "train", 2, 7, lanes=4, on_corrupt="skip")
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("hpctrain").addHandler(handler)
    try:
        for _ in zip(range(100), stream):  # 200 samples: more than an epoch of both sources
            pass
    finally:
        logging.getLogger("hpctrain").removeHandler(handler)
    assert stream.corrupt_shards >= 1 and len(warned) == stream.corrupt_shards, (stream.corrupt_shards, warned)
    assert all("shard skipped" in w and any(f"{bad}/{name} checksum mismatch" in w for name in names) for w in warned)


def test_resuming_with_a_begun_phase_or_sources_changed_is_refused(make_cfg, sources):
    """The run state against the resumed run's data group: a phase that has begun by the step it resumes at, or
    sources where it trained on data.path alone, are refused (one line); a phase yet to begin may change; a
    checkpoint older than mixtures (no data_mixture) is not checked."""
    from hpctrain.training.feed import check_bound, mixture
    from hpctrain.training.run import TrainingError

    dcfg = _cfg(make_cfg, sources, "data.schedule=[{step:3,weights:{math:1}}]").data
    later = _cfg(make_cfg, sources, "data.schedule=[{step:6,weights:{math:1}}]").data
    for run, words in (({"step": 4, "data_mixture": mixture(dcfg), "data_schedule": [[6, [0, 0, 1], 40]]},
                        "data.schedule=[[3, [0.0, 0.0, 1.0]]] but this run was trained with data.schedule=[]"),
                       ({"step": 4, "data_mixture": mixture(dcfg), "data_schedule": None},
                        "data.schedule=[[3, [0.0, 0.0, 1.0]]] but this run was trained with data.schedule=[]"),
                       ({"step": 4, "data_mixture": None, "data_schedule": None},
                        "data.sources=[['web', 0.5], ['code', 0.3], ['math', 0.2]] but this run was trained with "
                        "data.sources=[]")):
        with pytest.raises(TrainingError) as e:
            check_bound(run, dcfg, 0, sources[0].path)
        assert words in str(e.value), str(e.value)
    check_bound({"step": 4, "data_mixture": mixture(dcfg), "data_schedule": [[5, [0, 0, 1], 32]]}, later, 0,
                sources[0].path)
    check_bound({"step": 4}, dcfg, 0, sources[0].path)


def test_a_phase_stays_at_its_step_when_the_global_batch_changes_or_a_rollback_skips_data(make_cfg, sources, tmp_path):
    """Resumed with another train.global_batch, a begun phase keeps the sample it began at (the counts of every
    source continue from there); a phase yet to begin, after a resume or a rollback's skipped window, begins a
    global batch a step from where the run is."""
    from hpctrain.core.files import read_metrics
    from hpctrain.data.mixture import Schedule
    from hpctrain.training.feed import phase_starts
    from hpctrain.training.run import train

    anneal = "data.schedule=[{step:3,weights:{math:1}},{step:7,weights:{web:1}}]"
    run = str(tmp_path / "run")
    assert train(_cfg(make_cfg, sources, anneal, "train.max_steps=4"), run)["status"] == "completed"
    resumed = _cfg(make_cfg, sources, anneal, "train.max_steps=7", "train.global_batch=16")
    assert train(resumed, run)["status"] == "completed"
    records = {m["step"]: m for m in read_metrics(run) if "data_samples/web" in m}
    # steps 1-2: 16 samples at 0.5/0.3/0.2; steps 3-4 (8 each) and 5-6 (16 each) math alone; step 7 (16) web alone
    want = Schedule([(0, [0.5, 0.3, 0.2]), (16, [0, 0, 1]), (64, [1, 0, 0])]).counts(3, 1, 80).sum(axis=1)
    got = [records[7][f"data_samples/{s.name}"] for s in sources]
    assert got == list(want) == [8 + 16, 5, 3 + 48], (got, want)
    # a rollback from step 12 to the checkpoint of step 8, the data position past step 12's batch (sample 96)
    assert phase_starts(resumed.data, 8, 8, 96, [[3, [0, 0, 1], 16], [10, [1, 0, 0], 72]]) == \
        [[3, [0.0, 0.0, 1.0], 16], [7, [1.0, 0.0, 0.0], 16 + 4 * 8]]
