"""monitor.prometheus_port: the live metrics of rank 0 as a Prometheus scrape target (prometheus_client's server).

Every numeric value of the logged records becomes a gauge `hpctrain_<key>` (loss, grad_norm, lr, tokens_per_s,
mfu, mem_gb, val_loss, communication_overhead, comm_bytes, ...) labelled with the run's name and Slurm job, holding
its latest value; `hpctrain_alert_firing{rule}` is 1 while an alert rule fires. The server runs in a thread of
the main rank from the first step to the end of the run.
"""

from __future__ import annotations

import logging
import os
import re
import socket

from hpctrain.core.config import ConfigError, MonitorConfig
from hpctrain.monitoring.sink import Sink

log = logging.getLogger("hpctrain")

INSTALL = "pip install prometheus_client (or 'hpctrain[track]')"


def check_prometheus(mcfg: MonitorConfig, local: bool) -> None:
    """One-line ConfigErrors before anything starts: the library, and (a run on this machine) a port in use."""
    port = mcfg.prometheus_port
    if port is None:
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"monitor.prometheus_port={port} needs the prometheus_client package: {INSTALL}, or "
                          "drop monitor.prometheus_port") from None
    addr = mcfg.prometheus_addr
    if not _address(addr):
        raise ConfigError(f"monitor.prometheus_addr={addr!r} is not an address to serve on: use an IP address of "
                          "this node, 0.0.0.0 (every interface) or a host name")
    if local:  # (a submission's compute node is not this one: only the address's form is checked there)
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError as e:
                raise ConfigError(f"monitor.prometheus_port={port} cannot be served on {addr!r} "
                                  f"({e.strerror}): choose another port (0 picks a free one) or address") from None


def _address(addr: str) -> bool:
    """An IP address or a host name (RFC 1123 labels), as a server can bind to."""
    import ipaddress

    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    return 0 < len(addr) <= 253 and all(re.fullmatch(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)", label)
                                        for label in addr.rstrip(".").split("."))


def _gauge_name(key: str) -> str | None:
    name = "hpctrain_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name) else None


class PrometheusSink(Sink):
    """A metrics sink (and alert listener) serving the latest values over HTTP."""

    def __init__(self, mcfg: MonitorConfig, run_dir: str):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._registry = CollectorRegistry()  # this run's alone: a later run in the process starts clean
        self._gauge_cls = Gauge
        self._labels = {"run": os.path.basename(os.path.normpath(run_dir)), "job": os.environ.get("SLURM_JOB_ID", "")}
        self._gauges: dict[str, object] = {}  # by record key (None: not served)
        self._names: dict[str, str] = {}  # gauge name -> the key it serves
        self._alerts = Gauge("hpctrain_alert_firing", "1 while the alert rule fires", [*self._labels, "rule"],
                             registry=self._registry)
        self._server, self._thread = start_http_server(mcfg.prometheus_port, mcfg.prometheus_addr,
                                                       registry=self._registry)
        self.port = self._server.server_port
        log.info("Prometheus metrics at http://%s:%d/metrics", socket.gethostname(), self.port)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key not in self._gauges:
                name = _gauge_name(key)
                taken = self._names.get(name)
                if taken is not None:  # (two keys, one name: `loss/a-b` and `loss/a_b`; registering it again raised)
                    log.warning("Prometheus: %s would be the gauge %s, which is %s's: not served", key, name, taken)
                elif name is not None:
                    self._names[name] = key
                self._gauges[key] = None if name is None or taken is not None else self._gauge_cls(
                    name, f"hpctrain metric {key}, latest value", list(self._labels), registry=self._registry)
            gauge = self._gauges[key]
            if gauge is not None:
                gauge.labels(**self._labels).set(value)

    def alert(self, event: dict) -> None:
        if event.get("event") in ("firing", "cleared"):
            self._alerts.labels(**self._labels, rule=event["rule"]).set(1.0 if event["event"] == "firing" else 0.0)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def prometheus_sinks(mcfg: MonitorConfig, run_dir: str) -> list[PrometheusSink]:
    return [PrometheusSink(mcfg, run_dir)] if mcfg.prometheus_port is not None else []
