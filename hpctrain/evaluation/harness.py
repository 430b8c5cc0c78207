"""lm-evaluation-harness as the task and metric library, hpctrain's model as its `LM`.

`HpctrainLM` answers lm-eval's requests with a score function — in a run, the run's model in its own layout
(hpctrain.training.downstream) — and tokenizes, truncates and splits requests exactly as lm-eval's `--model hf`
does with the same tokenizer (both are lm-eval's `TemplateLM`; the rolling windows are its own utilities), so a
score here equals lm-eval's on the exported checkpoint. lm-eval runs as one process on every rank: its
requests are the same everywhere and the score function splits them over the data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence

from lm_eval import utils
from lm_eval.api.model import TemplateLM

from hpctrain.core.config import EvalConfig
from hpctrain.core.errors import ConfigError

log = logging.getLogger("hpctrain")

# (tokens of context + continuation, at most max_length + 1 of them; how many of the last are the continuation)
Row = tuple[list[int], int]
ScoreFn = Callable[[Sequence[Row]], list[tuple[float, bool]]]
# ([(context tokens, tokens to generate at most)], done(generated tokens) -> bool) -> the greedy tokens of each
GenerateFn = Callable[[Sequence[tuple[list[int], int]], Callable[[int, list[int]], bool]], list[list[int]]]


class HpctrainLM(TemplateLM):
    """lm-eval's `LM` over a score function, tokenizing and truncating as lm-eval's hf model does."""

    backend = "causal"

    def __init__(self, tokenizer, score: ScoreFn, max_length: int, generate: GenerateFn | None = None):
        super().__init__()
        self.tokenizer, self._score, self._max_length, self._generate = tokenizer, score, max_length, generate

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's hf model: BOS, else EOS, before an empty context
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows, n = [], self._max_length
        for _, context, continuation in requests:
            if not continuation or len(continuation) > n:
                raise ConfigError(f"a request's continuation of {len(continuation)} tokens does not fit "
                                  f"eval.max_length={n}: raise eval.max_length (up to model.max_seq_len)")
            rows.append(((context + continuation)[-(n + 1):], len(continuation)))
        return self._score(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            mine = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self._max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in mine]
            counts.append(len(mine))
        scores, out, at = self._loglikelihood_tokens(windows), [], 0
        for n in counts:
            out.append(sum(ll for ll, _ in scores[at:at + n]))
            at += n
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, as lm-eval's hf model makes them: the context left-truncated to max_length −
        max_gen_toks, generation until a stop sequence (EOS included) or max_gen_toks, the text cut at the first stop
        sequence."""
        from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        rows, stops = [], []
        for context, gen_kwargs in (r.args for r in requests):
            kwargs = greedy_kwargs(gen_kwargs, self._max_length, "a generative task")
            until, n = handle_stop_sequences(kwargs.pop("until", None), eos=eos), kwargs.pop("max_gen_toks")
            rows.append((self.tok_encode(context)[-(self._max_length - n):], n))
            stops.append(until)
        texts = []
        for tokens, until in zip(self._generate(rows, self._stopped_by(stops)), stops):
            texts.append(postprocess_generated_text(self.tok_decode(tokens), until, None))
        return texts

    def _stopped_by(self, stops: list[list[str]]):
        """done(i, tokens): whether row i's text holds one of its stop sequences."""
        def done(i: int, tokens: list[int]) -> bool:
            text = self.tok_decode(tokens, skip_special_tokens=False)
            return any(term and term in text for term in stops[i])

        return done


def greedy_kwargs(gen_kwargs: dict, max_length: int, task: str) -> dict:
    """`task`'s generation_kwargs as lm-eval's hf model reads them (256 new tokens unless max_gen_toks; a temperature
    samples), checked for what hpctrain generates: greedily, fewer new tokens than eval.max_length (one-line
    ConfigError)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), 256)
    if kwargs.get("do_sample") or kwargs.get("temperature"):
        raise ConfigError(f"{task} asks for sampling ({dict(gen_kwargs)}): hpctrain generates greedily only; set "
                          "do_sample: false and no temperature in the task's generation_kwargs")
    if kwargs["max_gen_toks"] >= max_length:
        raise ConfigError(f"{task} asks for {kwargs['max_gen_toks']} new tokens (max_gen_toks, 256 when unset), not "
                          f"below eval.max_length={max_length}: lower its max_gen_toks or raise eval.max_length")
    return kwargs


_managers: dict = {}


def task_manager(include_path: str | None, tasks: Sequence[str]):
    """lm-eval's TaskManager: only eval.include_path's tasks when they are all there (indexing lm-eval's ~15k
    tasks takes seconds), else those and lm-eval's own; made once per process."""
    from lm_eval.tasks import TaskManager

    key = (include_path, tuple(tasks))
    if key not in _managers:
        manager = None
        if include_path:
            local = TaskManager(include_path=include_path, include_defaults=False)
            manager = local if set(local.match_tasks(list(tasks))) == set(tasks) else None
        _managers[key] = manager or TaskManager(include_path=include_path)
    return _managers[key]


def check_tasks(ecfg: EvalConfig, max_length: int) -> list[str]:
    """eval.tasks that lm-eval knows and can load (their data found: on an offline cluster, local files or a filled
    datasets cache), generative ones greedy and shorter than `max_length`, eval.num_fewshot examples there to draw;
    eval.include_path a directory. One-line ConfigError otherwise. Returns the generative ones."""
    if ecfg.include_path and not os.path.isdir(os.path.expanduser(ecfg.include_path)):
        raise ConfigError(f"eval.include_path={ecfg.include_path} is not a directory: point it at your task YAML files")
    tasks = list(ecfg.tasks)
    manager = task_manager(include_dir(ecfg), tasks)
    unknown = sorted(set(tasks) - set(manager.match_tasks(tasks)))
    broken = _unparsed_task_file(include_dir(ecfg), unknown) if unknown and ecfg.include_path else None
    if broken:  # (lm-eval passes over a YAML file it cannot parse: its task would read as unknown)
        raise ConfigError(f"eval.tasks: {broken}: fix the file")
    if unknown:
        raise ConfigError(f"eval.tasks: {', '.join(unknown)} unknown to lm-eval (`lm_eval ls tasks` lists its tasks; "
                          "your own: their YAML in eval.include_path=DIR)")
    try:
        loaded = manager.load(tasks)["tasks"]  # every leaf task, groups expanded
    except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise many kinds; the message is what matters
        raise ConfigError(f"eval.tasks={tasks}: lm-eval could not load them ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}): check the task's data files (offline: set "
                          "HF_DATASETS_OFFLINE=1 with a filled cache, or use local data_files)") from None
    generative = sorted(name for name, task in loaded.items() if task.OUTPUT_TYPE == "generate_until")
    sampled = [name for name in generative if (loaded[name].config.generation_kwargs or {}).get("do_sample")]
    if sampled:
        raise ConfigError(f"eval.tasks: {', '.join(sampled)} sample their generations (do_sample: true), and hpctrain "
                          "generates greedily: set do_sample: false in the task's generation_kwargs")
    for name in generative:
        greedy_kwargs(loaded[name].config.generation_kwargs, max_length, f"eval.tasks: {name}")
    for name, task in loaded.items() if ecfg.num_fewshot else ():
        _check_fewshot(name, task, ecfg.num_fewshot)
    return generative


def _check_fewshot(name: str, task, shots: int) -> None:
    """eval.num_fewshot examples to draw for `task` besides the document they precede (lm-eval's sampler)."""
    try:
        pool = len(task.fewshot_docs())
    except Exception:  # noqa: BLE001 - a task without a few-shot pool, or one lm-eval builds lazily: its own checks
        return
    if shots >= pool:
        raise ConfigError(f"eval.num_fewshot={shots} but {name} has {pool} documents to draw examples from, one of "
                          f"them the document scored: at most {pool - 1}")


def _unparsed_task_file(include_path: str, names: Sequence[str]) -> str | None:
    """'<file> declares task NAME but does not parse (...)' for the first YAML file under `include_path` with a
    `task: NAME` line for one of `names` that YAML cannot read (lm-eval's `!function` tags read as any tag)."""
    import glob
    import re

    import yaml

    from hpctrain.core.files import FileCheckError, read_bytes

    class _AnyTag(yaml.SafeLoader):
        pass

    _AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(glob.glob(os.path.join(include_path, "**", "*.y*ml"), recursive=True)):
        try:
            text = read_bytes(path, 2**20).decode("utf-8", errors="replace")
        except (OSError, FileCheckError):
            continue
        named = [n for n in names if re.search(rf"^task:\s*['\"]?{re.escape(n)}['\"]?\s*$", text, re.M)]
        if named:
            try:
                yaml.load(text, Loader=_AnyTag)  # noqa: S506 - a SafeLoader subclass
            except yaml.YAMLError as e:
                return f"{path} declares task {named[0]} but does not parse ({' '.join(str(e).split())[:200]})"
    return None


def include_dir(ecfg: EvalConfig) -> str | None:
    """eval.include_path as an absolute path (None without one)."""
    return os.path.abspath(os.path.expanduser(ecfg.include_path)) if ecfg.include_path else None


def evaluate(lm, ecfg: EvalConfig, log_samples: bool = False) -> dict:
    """lm-eval's own evaluation of eval.tasks with `lm` (its results dict; empty on a rank whose LOCAL_RANK is not 0:
    lm-eval returns them on one process of a node); global random state untouched."""
    import random

    import numpy as np
    import torch
    from lm_eval import evaluator

    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]), _scores_only(evaluator):
            return evaluator.simple_evaluate(
                model=lm, tasks=list(ecfg.tasks), num_fewshot=ecfg.num_fewshot, limit=ecfg.limit,
                task_manager=task_manager(include_dir(ecfg), list(ecfg.tasks)), log_samples=log_samples,
                bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                verbosity="ERROR") or {}
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


@contextlib.contextmanager
def _scores_only(evaluator):
    """lm-eval adds the environment (torch's collect_env: `pip list`, nvidia-smi on a GPU node; 0.33 s here, 2.7 s
    the first time) and git's hash (a `fatal: not a git repository` line outside one) to every result, on one rank
    while the others wait; hpctrain keeps the scores only."""
    names = [n for n in ("add_env_info", "get_git_commit_hash") if hasattr(evaluator, n)]
    saved = {n: getattr(evaluator, n) for n in names}
    for n in names:
        setattr(evaluator, n, lambda *_: None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(evaluator, n, f)


SAMPLE_KEYS = ("doc_id", "target", "arguments", "resps", "filtered_resps")


def write_samples(results: dict, out_dir: str) -> list[str]:
    """lm-eval's logged samples (evaluate(..., log_samples=True)): <out_dir>/<task>.jsonl, a line per document with
    its requests and answers (the log-likelihoods); the files written."""
    from hpctrain.core.files import atomic_write

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for task, samples in results.get("samples", {}).items():
        path = os.path.join(out_dir, f"{task}.jsonl")
        lines = (json.dumps({k: s.get(k) for k in SAMPLE_KEYS}, default=str) for s in samples)
        atomic_write(path, "".join(line + "\n" for line in lines))
        written.append(path)
    return written


def scores(results: dict) -> dict[str, float]:
    """lm-eval's results as metric names: eval/<task>/<metric> (a filter other than `none` appended:
    <metric>_<filter>); standard errors left out."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[f"eval/{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out
