"""MLflow and Weights & Biases beside TensorBoard (`logging.trackers`): metrics sinks of the main rank, checked
before anything starts (`check_trackers`).

- What: every finite number of a logged record under TensorBoard's names (`train/loss`, `val/loss`, ...) at
  the record's step; the resolved config (MLflow: flattened `train.max_steps`-style params, values cut to
  MLflow's length limit; W&B: the nested config); each alert event (`alert/<rule>` 1 firing, 0 cleared, and
  the last event's text under `alert_state/<rule>`).
- Where: MLflow: `logging.mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI, else a SQLite store (MLflow's own
  local default; its file store is deprecated) in `<sweep_dir>/mlflow/` for a sweep point, `<run_dir>/mlflow/`
  otherwise. W&B: `<run_dir>/wandb/`, offline unless `logging.wandb_mode=online`.
- Grouping: a sweep point (a run dir below a directory holding Hydra's multirun.yaml) goes to the MLflow
  experiment named by the sweep dir (unless `logging.mlflow_experiment` is set) and the W&B group of that name.
- Resume: `<run_dir>/trackers.json` keeps the tracker runs' ids; a resumed or requeued run continues them. Steps
  a crashed attempt logged after its checkpoint (or steps re-done after a loss-spike rollback) are logged again:
  MLflow's history then holds both values of such a step, W&B keeps the first (it drops steps below its highest).
- Failures: an MLflow server that does not answer, or a SQLite URI naming a file that is no SQLite database, is
  refused before anything starts; a tracker that cannot start its run stops the run with one line; later writes
  never block or stop training (MLflow logs in the background and reports failed batches in the log; W&B's service buffers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import netrc
import os
import re
import sys
import time
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit, urlunsplit

from hpctrain.core.config import ConfigError, LoggingConfig, WandbMode
from hpctrain.core.errors import TrainingError
from hpctrain.core.files import open_checked, read_object, write_json
from hpctrain.monitoring.sink import Sink, display_name

log = logging.getLogger("hpctrain")
TRACKERS_FILE = "trackers.json"
SWEEP_MARKER = "multirun.yaml"  # Hydra's basic sweeper writes it into the sweep dir before any point starts
_SWEEP_DEPTH = 3  # hydra.sweep.subdir may nest (e.g. lr=1e-3/bs=8)
_WANDB_BAD = set("/\\#?%:")
_MLFLOW_KEY_BAD = re.compile(r"[^\w\-. :/]")  # MLflow's allowed key characters
_INSTALL = "pip install -e '.[track]' in an hpctrain checkout"
SERVER_CHECK_S = 5.0  # an MLflow server's /health must answer within this, before the run starts


def chosen(trackers) -> set[str]:
    return {str(getattr(t, "value", t)) for t in trackers}


# ------------------------------------------------------------------------------------------------ checks


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_trackers(lcfg: LoggingConfig, local: bool = True) -> None:
    """One-line ConfigErrors for tracker settings that cannot work, before anything is spawned or written;
    `local`: the run starts here (a server it logs to must answer here; a submission's node may see other ones)."""
    trackers = chosen(lcfg.trackers)
    if "mlflow" in trackers:
        _check_mlflow(lcfg, local)
    if "wandb" in trackers:
        _check_wandb(lcfg)


def _check_mlflow(lcfg: LoggingConfig, local: bool) -> None:
    if not _installed("mlflow"):
        raise ConfigError("logging.trackers has mlflow but the mlflow package is not installed: pip install "
                          f"mlflow-skinny sqlalchemy alembic (or {_INSTALL}), or drop mlflow from logging.trackers")
    uri = lcfg.mlflow_tracking_uri
    if uri is not None:
        parts = urlsplit(uri)
        # scheme://host..., or scheme:/path (sqlite:////abs/mlflow.db); "localhost:5000" lacks its http://
        uri_like = len(parts.scheme) > 1 and (parts.netloc or parts.path.startswith("/"))
        if not (uri_like or uri in ("databricks", "databricks-uc")) or any(c.isspace() for c in uri) or (
                parts.scheme in ("http", "https") and not parts.hostname):
            raise ConfigError(f"logging.mlflow_tracking_uri={uri!r} is not a tracking URI: use http://HOST:PORT of "
                              "an MLflow server, or sqlite:////ABS/PATH/mlflow.db (null: a SQLite store in the run "
                              "dir, or the sweep dir)")
    exp = lcfg.mlflow_experiment
    if exp is not None and (not exp.strip() or len(exp) > 500 or any(c in exp for c in "\n\r\0")):
        raise ConfigError(f"logging.mlflow_experiment={exp!r} is not an experiment name (1 to 500 characters on "
                          "one line): e.g. logging.mlflow_experiment=llm-pretrain, or null for the default")
    effective = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
    if effective.startswith("sqlite:") and not (_installed("sqlalchemy") and _installed("alembic")):
        raise ConfigError("a SQLite MLflow store (the default without logging.mlflow_tracking_uri) needs sqlalchemy "
                          f"and alembic: pip install sqlalchemy alembic (or {_INSTALL}), or set "
                          "logging.mlflow_tracking_uri=http://HOST:PORT of an MLflow server")
    if effective.startswith("sqlite:///"):
        _check_sqlite_file(effective[len("sqlite:///"):], effective)
    elif effective.startswith(("http://", "https://")) and local:
        _check_server(effective)


_SQLITE_HEADER = b"SQLite format 3\x00"


def _check_sqlite_file(path: str, uri: str) -> None:
    """An existing file at a SQLite tracking URI must be an SQLite database: MLflow would write its tables into
    anything else (a user's file), or fail with a traceback after training started."""
    if not os.path.lexists(path) or os.path.isfile(path) and os.path.getsize(path) == 0:
        return
    try:
        with open_checked(path, 2**62) as f:
            head = f.read(len(_SQLITE_HEADER))
    except (OSError, ValueError) as e:
        raise ConfigError(f"logging.mlflow_tracking_uri={redact(uri)}: {path} cannot be read ({e}): point it at an "
                          "MLflow SQLite database or a new file") from None
    if head != _SQLITE_HEADER:
        raise ConfigError(f"logging.mlflow_tracking_uri={redact(uri)}: {path} is not an SQLite database: point it "
                          "at an MLflow SQLite database or a new file (nothing of it is touched)")


def _check_server(uri: str) -> None:
    """An MLflow server answers before the run starts: the client would otherwise retry for minutes (7 retries
    with backoff) at the first step and then stop the run."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=SERVER_CHECK_S).close()
    except urllib.error.HTTPError:  # it answered (a proxy's or an auth's refusal): the client words the rest
        return
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"logging.mlflow_tracking_uri={redact(uri)} does not answer ({reason}): start the MLflow "
                          "server or fix the URI, or drop mlflow from logging.trackers") from None


def _check_wandb(lcfg: LoggingConfig) -> None:
    if not _installed("wandb"):
        raise ConfigError(f"logging.trackers has wandb but the wandb package is not installed: pip install wandb "
                          f"(or {_INSTALL}), or drop wandb from logging.trackers")
    project = lcfg.wandb_project
    if not project or len(project) > 128 or project != project.strip() or _WANDB_BAD & set(project):
        raise ConfigError(f"logging.wandb_project={project!r} is not a W&B project name (1 to 128 characters, "
                          "none of / \\ # ? % :): e.g. logging.wandb_project=llm-pretrain")
    if WandbMode(lcfg.wandb_mode) == WandbMode.online and not _wandb_credentials():
        raise ConfigError("logging.wandb_mode=online needs W&B credentials here: run `wandb login` (or set "
                          "WANDB_API_KEY), or keep logging.wandb_mode=offline and upload later with "
                          "`wandb sync <run_dir>/wandb/offline-run-*`")


def _wandb_credentials() -> bool:
    """Whether wandb will find credentials without asking (an interactive prompt would hang a batch job)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# -------------------------------------------------------------------------------------- where a run goes


@dataclass(frozen=True)
class Placement:
    run_dir: str  # absolute
    sweep: str | None  # the sweep dir of a sweep point, absolute
    name: str  # the tracker run's display name

    @property
    def store_dir(self) -> str:
        """The default local MLflow store: one per sweep, so that its points share an experiment."""
        return os.path.join(self.sweep or self.run_dir, "mlflow")


def sweep_of(run_dir: str) -> str | None:
    """The sweep dir `run_dir` is a point of (hydra.sweep.dir: the nearest parent holding multirun.yaml), or None.
    Read from the filesystem, so it holds in every process: forked ranks, srun tasks, a requeued job."""
    path = os.path.abspath(run_dir)
    for _ in range(_SWEEP_DEPTH):
        path = os.path.dirname(path)
        if os.path.isfile(os.path.join(path, SWEEP_MARKER)):
            return path
    return None


def placement(run_dir: str) -> Placement:
    run_dir = os.path.abspath(run_dir)
    sweep = sweep_of(run_dir)
    base = sweep or run_dir
    head = "/".join(base.split(os.sep)[-2:])  # e.g. 2025-01-31/12-00-00: a date and time, as Hydra names dirs
    return Placement(run_dir, sweep, f"{head}/{os.path.relpath(run_dir, sweep)}" if sweep else head)


def mlflow_uri(lcfg: LoggingConfig, place: Placement) -> str:
    return (lcfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or "sqlite:///" + os.path.join(place.store_dir, "mlflow.db"))


def redact(uri: str) -> str:
    """A URI without the password it may carry (it goes into logs and trackers.json)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"))


# ---------------------------------------------------------------------------------------- ids and config


def load_ids(run_dir: str) -> dict:
    return read_object(os.path.join(run_dir, TRACKERS_FILE)) or {}


def save_id(run_dir: str, tracker: str, doc: dict) -> None:
    write_json(os.path.join(run_dir, TRACKERS_FILE), {**load_ids(run_dir), tracker: doc})


def resolved_config(cfg, run_dir: str) -> dict:
    """The config (the typed objects a run is built from, or a DictConfig) as plain data (enums as names), with the
    run dir this run really uses."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        conf = _plain(cfg)
    else:
        try:
            conf = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside Hydra: the unresolved text is still a record
            conf = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    conf.pop("hydra", None)
    conf["run_dir"] = os.path.abspath(run_dir)
    return conf


def _plain(value):
    """Dataclass objects as dicts (keys a `+key=` override added included), enums as their names."""
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def flatten(conf: dict, prefix: str = "") -> dict[str, str]:
    """{"train.max_steps": "200", ...}: scalars as JSON (null, true, 0.0003), lists as JSON, strings as they are."""
    flat = {}
    for key, value in conf.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


def named(record: dict):
    """(name, value) of each finite number in a record, under TensorBoard's names."""
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            yield display_name(key), value


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _alert_text(event: dict) -> str:
    """One line of an alerts.jsonl event (rules firing or clearing, inactive rules, stragglers, loss spikes)."""
    kind, step = event.get("event"), event.get("step")
    if kind == "inactive":
        return f"inactive: {event.get('metric')} ({event.get('reason')})"
    where = f" at step {step}" if step is not None else ""
    if isinstance(event.get("value"), (int, float)) and isinstance(event.get("threshold"), (int, float)):
        return (f"{kind}{where}: {event.get('metric')} {event['value']:.4g} (threshold {event.get('when')} "
                f"{event['threshold']:g})")
    rest = {k: v for k, v in event.items() if k not in ("time", "event", "rule", "step")}
    return f"{kind}{where}: {json.dumps(rest, default=str)}"


def _alert_value(event: dict) -> float | None:
    """`alert/<rule>` at the event's step: 0 when it clears, 1 for any other event; None without a step."""
    if event.get("event") == "inactive" or event.get("step") is None:
        return None
    return 0.0 if str(event.get("event")).endswith("cleared") else 1.0


def _final_status(last_step: int, max_steps: int) -> str:
    """The tracker run's state as the run closes: an exception on its way out (close is called from the
    trainer's `finally`) is a failure, Ctrl-C a kill; stopping before the last step (a signal) a kill too."""
    exc = sys.exc_info()[1]
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED"
    if exc is not None:
        return "FAILED"
    return "FINISHED" if last_step >= max_steps else "KILLED"


# -------------------------------------------------------------------------------------------------- MLflow


@contextlib.contextmanager
def _store_lock(uri: str):
    """Serialise the first use of a SQLite store: its tables are made on first use, and two sweep points doing it
    at once break the migration. Other stores need no lock (experiment creation races are handled below)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    folder = os.path.dirname(os.path.abspath(uri[len("sqlite:///"):]))
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)  # the database's directory itself: no lock file beside someone's files
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Sink(Sink):
    """What both trackers share: a write that fails is reported (the first time) and dropped, never raised."""

    label = "tracker"
    failures = 0

    def write(self, record: dict) -> None:
        self._safely(self._write, record)

    def alert(self, event: dict) -> None:
        self._safely(self._alert, event)

    def _safely(self, send, item: dict) -> None:
        try:
            send(item)
        except Exception as e:  # noqa: BLE001 - a tracker outage must not end a training run
            self.failures += 1
            if self.failures == 1:
                log.warning("%s: could not log (%s: %s); training goes on, later records are still sent", self.label,
                            type(e).__name__, e)


class MLflowSink(_Sink):
    """One MLflow run per training run, continued across resumes (its id in trackers.json)."""

    label = "MLflow"

    def __init__(self, place: Placement, lcfg: LoggingConfig, params: dict[str, str], max_steps: int, start_step: int):
        from mlflow import MlflowClient
        from mlflow.utils import validation

        self.uri, self.max_steps, self.last_step = mlflow_uri(lcfg, place), max_steps, start_step
        self.ops = []  # background log_batch operations not yet waited for
        self.param_limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        self.tag_limit = getattr(validation, "MAX_TAG_VAL_LENGTH", 5000)
        saved = load_ids(place.run_dir).get("mlflow") or {}
        try:
            with _store_lock(self.uri):  # (making the client opens the store, creating its tables if new)
                self.client = MlflowClient(tracking_uri=self.uri)
                self.run_id = self._reuse(saved)
                self.resumed = self.run_id is not None
                self.run_id = self.run_id or self._create(lcfg, place)
        except TrainingError:
            raise
        except Exception as e:  # noqa: BLE001 - MlflowException, a connection error, a store that cannot open
            raise TrainingError(f"MLflow at {redact(self.uri)} cannot start a run ({type(e).__name__}: "
                                f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}): check "
                                "logging.mlflow_tracking_uri and that its server is up, or drop mlflow from "
                                "logging.trackers") from None
        save_id(place.run_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": redact(self.uri)})
        self._log_params(params)
        log.info("MLflow: %s run %s at %s", "continuing" if self.resumed else "started", self.run_id,
                 redact(self.uri))

    def _reuse(self, saved: dict) -> str | None:
        """The run this run dir already has in this store, set running again; None when there is none."""
        run_id = saved.get("run_id")
        if not run_id:
            return None
        if saved.get("tracking_uri") != redact(self.uri):
            log.warning("MLflow: this run's MLflow run %s is in another store (%s); starting a new one in %s",
                        run_id, saved.get("tracking_uri"), redact(self.uri))
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            log.warning("MLflow: run %s is gone from %s; starting a new one", run_id, redact(self.uri))
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _create(self, lcfg: LoggingConfig, place: Placement) -> str:
        from mlflow.exceptions import MlflowException

        name = lcfg.mlflow_experiment or place.sweep or "hpctrain"
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            own = not lcfg.mlflow_tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI")
            try:  # the default store keeps its artifacts beside it, not in the working directory
                exp_id = self.client.create_experiment(
                    name, artifact_location=os.path.join(place.store_dir, "artifacts") if own else None)
            except MlflowException:  # another point of the sweep made it meanwhile
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                raise TrainingError(f"MLflow experiment {name!r} is deleted in {redact(self.uri)}: restore it "
                                    f"(mlflow experiments restore --experiment-id {exp.experiment_id}) or set "
                                    "logging.mlflow_experiment to another name")
            exp_id = exp.experiment_id
        tags = {"hpctrain.run_dir": place.run_dir, **({"hpctrain.sweep": place.sweep} if place.sweep else {})}
        return self.client.create_run(exp_id, run_name=place.name, tags=tags).info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """The config as params. MLflow refuses to change a param: on resume the keys whose value changed
        (train.max_steps raised, say) are recorded as `resumed.<key>` tags instead."""
        from mlflow.entities import Param, RunTag

        params = {_MLFLOW_KEY_BAD.sub("_", k)[:250]: _clip(v, self.param_limit) for k, v in params.items()}
        old = self.client.get_run(self.run_id).data.params if self.resumed else {}
        new = [Param(k, v) for k, v in params.items() if k not in old]
        changed = [RunTag(f"resumed.{k}"[:250], _clip(v, self.tag_limit)) for k, v in params.items()
                   if k in old and old[k] != v]
        if changed:
            log.info("MLflow: changed since the run started (tags resumed.*): %s", ", ".join(t.key[8:] for t in changed))
        for i in range(0, max(len(new), len(changed)), 100):  # MLflow takes at most 100 params + tags per call
            self.client.log_batch(self.run_id, params=new[i:i + 100], tags=changed[i:i + 100])

    def _write(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, record["step"]) for name, value in named(record)]
        self.last_step = max(self.last_step, record["step"])
        if metrics:  # in the background: a slow or unreachable server never stalls a training step
            self._pending(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))

    def _alert(self, event: dict) -> None:
        from mlflow.entities import Metric, RunTag

        value = _alert_value(event)
        metrics = [Metric(f"alert/{event['rule']}", value, int(time.time() * 1000), event["step"])] if value is not None \
            else []
        tags = [RunTag(f"alert_state/{event['rule']}", _clip(_alert_text(event), self.tag_limit))]
        self._pending(self.client.log_batch(self.run_id, metrics=metrics, tags=tags, synchronous=False))

    def _pending(self, op) -> None:
        """Keep the background batches to wait for at the end (mlflow.flush_async_logging() would flush the
        default store, ./mlflow.db, not this client's); the oldest, long written, are waited for in bulk."""
        self.ops.append(op)
        if len(self.ops) > 1000:
            for old in self.ops[:500]:
                old.wait()
            del self.ops[:500]

    def close(self) -> None:
        status = _final_status(self.last_step, self.max_steps)
        try:
            for op in self.ops:
                op.wait()
            self.client.set_terminated(self.run_id, status)
        except Exception as e:  # noqa: BLE001 - the run's own outcome matters more than the tracker's record
            log.error("MLflow: could not close run %s (%s): %s", self.run_id, status, e)


# ---------------------------------------------------------------------------------------------------- W&B


class WandbSink(_Sink):
    """One W&B run per training run, continued across resumes (its id in trackers.json); files under
    <run_dir>/wandb (offline: one offline-run-* dir per attempt, all with the same id, for `wandb sync`)."""

    label = "W&B"

    def __init__(self, place: Placement, lcfg: LoggingConfig, conf: dict, max_steps: int, start_step: int):
        import wandb

        self.max_steps, self.last_step = max_steps, start_step
        saved = load_ids(place.run_dir).get("wandb") or {}
        mode = WandbMode(lcfg.wandb_mode).value
        group = place.sweep[-128:] if place.sweep else None  # W&B's limit on a group name
        try:
            self.run = wandb.init(project=lcfg.wandb_project, group=group, name=place.name, id=saved.get("id"),
                                  resume="allow", dir=place.run_dir, mode=mode, job_type="train")
        except Exception as e:  # noqa: BLE001 - wandb's errors: no network, no login, a bad entity
            raise TrainingError(f"W&B cannot start a run ({type(e).__name__}: {str(e).strip()[:300]}): check "
                                "logging.wandb_project and your login, use logging.wandb_mode=offline, or drop "
                                "wandb from logging.trackers") from None
        save_id(place.run_dir, "wandb", {"id": self.run.id, "project": lcfg.wandb_project, "mode": mode})
        # allow_val_change: a resumed run may change a key (train.max_steps raised); W&B keeps the latest.
        self.run.config.update(conf, allow_val_change=True)
        log.info("W&B: %s run %s (%s%s)", "continuing" if saved.get("id") == self.run.id else "started", self.run.id,
                 mode, f", group {group}" if group else "")

    def _write(self, record: dict) -> None:
        data = dict(named(record))
        if data and any(k.startswith("eval/") for k in data) and record["step"] < self.last_step:
            # an eval job's scores arrive after later steps, and W&B's own step only grows: on their own axis
            self.run.define_metric("eval/*", step_metric="eval/step")
            self.run.log({**data, "eval/step": record["step"]})
            return
        self.last_step = max(self.last_step, record["step"])
        if data:
            self.run.log(data, step=record["step"])

    def _alert(self, event: dict) -> None:
        # wandb.alert needs the network (and a W&B server): the event is logged as data instead.
        self.run.summary[f"alert_state/{event['rule']}"] = _alert_text(event)
        value = _alert_value(event)
        if value is not None:
            self.run.log({f"alert/{event['rule']}": value}, step=event["step"])

    def close(self) -> None:
        status = _final_status(self.last_step, self.max_steps)
        try:
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        except Exception as e:  # noqa: BLE001 - as for MLflow
            log.error("W&B: could not finish run %s: %s", self.run.id, e)


def tracker_sinks(lcfg: LoggingConfig, run_dir: str, start_step: int, max_steps: int, conf: dict) -> list:
    """The MLflow and W&B sinks `logging.trackers` selects (main rank), each given the run's config `conf`
    (`resolved_config`); their packages are imported only here."""
    trackers = chosen(lcfg.trackers)
    if not trackers & {"mlflow", "wandb"}:
        return []
    place = placement(run_dir)
    sinks = []
    try:
        if "mlflow" in trackers:
            sinks.append(MLflowSink(place, lcfg, flatten(conf), max_steps, start_step))
        if "wandb" in trackers:
            sinks.append(WandbSink(place, lcfg, conf, max_steps, start_step))
    except BaseException:
        for sink in sinks:  # (closed as failed: an exception is on its way out)
            sink.close()
        raise
    return sinks
