"""monitor.prometheus_port: rank 0's live metrics scraped over HTTP while a real run trains, the alert gauge, the
server gone at the end; a port in use is one line before anything starts."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request

import pytest
from helpers import one_line, records

from hpctrain.core.config import ConfigError
from hpctrain.runtime.spawn import free_port


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.read().decode()


def _value(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.multiproc
def test_the_live_metrics_are_scraped_during_the_run(make_cfg, tmp_path):
    from hpctrain.training.run import train

    port = free_port()
    scrapes: list[str] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            with contextlib.suppress(OSError):  # not serving yet, or any more
                scrapes.append(_scrape(port))
            time.sleep(0.02)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    # A rule that fires at once (loss above 0 for 0 s): its gauge is 1 while the run lasts.
    cfg = make_cfg("train.max_steps=40", "train.log_every=1", f"monitor.prometheus_port={port}",
                   "monitor.prometheus_addr=127.0.0.1", "parallel=ddp", "parallel.dp=2", "monitor.sample_every=5",
                   "+monitor.rules.always={metric:loss,threshold:0.0,when:above,for_s:0,action:warn}")
    try:
        assert train(cfg, str(tmp_path / "run"))["status"] == "completed"
    finally:
        done.set()
        thread.join()
    live = [s for s in scrapes if "hpctrain_loss{" in s]
    assert live, f"no scrape with the loss among {len(scrapes)}"
    last = live[-1]
    logged = {r["step"]: r for r in records(tmp_path / "run") if "loss" in r}
    step = int(_value(last, "hpctrain_step"))
    # A scrape may fall between the record's gauges being set: the step's loss or the one before.
    assert any(_value(last, "hpctrain_loss") == pytest.approx(logged[s]["loss"], rel=1e-6) for s in (step, step - 1)
               if s in logged)
    assert 'run="run"' in last and _value(last, "hpctrain_alert_firing") == 1.0
    assert any("hpctrain_comm_bytes{" in s for s in live)  # a sampled step's figures too
    with pytest.raises(OSError):  # the server went with the run
        _scrape(port)


def test_a_port_in_use_is_one_line_before_anything_starts(make_cfg, tmp_path):
    from hpctrain.training.run import prepare

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            prepare(make_cfg(f"monitor.prometheus_port={port}", "monitor.prometheus_addr=127.0.0.1"))
    one_line(e, f"monitor.prometheus_port={port}", "0 picks a free one")
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg("monitor.prometheus_port=70000"))
    one_line(e, "monitor.prometheus_port=70000")


def test_downstream_scores_are_gauges_too(tmp_path):
    """An eval record (in the loop, or an eval job's forwarded at its step) reaches the scrape as one gauge per
    task and metric: hpctrain_eval_<task>_<metric>."""
    from hpctrain.core.config import MonitorConfig
    from hpctrain.monitoring.prometheus import PrometheusSink

    sink = PrometheusSink(MonitorConfig(prometheus_port=0, prometheus_addr="127.0.0.1"), str(tmp_path / "run"))
    try:
        sink.write({"step": 4, "eval/hpc_mc/acc": 0.4, "eval/hpc_ppl/word_perplexity": 12.5})
        text = _scrape(sink.port)
    finally:
        sink.close()
    assert _value(text, "hpctrain_eval_hpc_mc_acc") == 0.4 and _value(text, "hpctrain_step") == 4
    assert _value(text, "hpctrain_eval_hpc_ppl_word_perplexity") == 12.5


def test_two_keys_of_one_gauge_name_keep_the_run_going(tmp_path):
    """Mixture sources `a-b` and `a_b` make the same gauge name: the first is served, the second named in a warning
    (registering the name again raised ValueError, "Duplicated timeseries", in the middle of the run)."""
    import logging

    from helpers import WarningLines

    from hpctrain.core.config import MonitorConfig
    from hpctrain.monitoring.prometheus import PrometheusSink

    warned = WarningLines()
    logging.getLogger("hpctrain").addHandler(warned)
    sink = PrometheusSink(MonitorConfig(prometheus_port=0, prometheus_addr="127.0.0.1"), str(tmp_path / "run"))
    try:
        sink.write({"step": 1, "loss/a-b": 2.0, "loss/a_b": 3.0})
        sink.write({"step": 2, "loss/a-b": 1.5, "loss/a_b": 2.5})
        text = _scrape(sink.port)
    finally:
        sink.close()
        logging.getLogger("hpctrain").removeHandler(warned)
    assert _value(text, "hpctrain_loss_a_b") == 1.5 and _value(text, "hpctrain_step") == 2
    assert len(warned.messages) == 1 and "loss/a_b would be the gauge hpctrain_loss_a_b" in warned.messages[0]
