"""Energy per token and per run, where the hardware reports it: NVML's energy counter of each GPU (one per rank),
or on a CPU node RAPL's package counters (/sys/class/powercap/intel-rapl:N, read by the node's first rank). The
ranks' joules are summed at each logged step (`energy_j`, `joules_per_token` in the record) and the run's total goes
into result.json with its cost and CO₂ at monitor.energy_price_per_kwh / monitor.co2_g_per_kwh. A missing source is
named (`energy.absent`), never invented. (Slurm's ConsumedEnergy needs the cluster's acct_gather_energy plugin;
`sacct -o ConsumedEnergy` shows it there.)
"""

from __future__ import annotations

import glob
import os

import torch

from hpctrain.parallel.vote import all_reduced

RAPL = "/sys/class/powercap"


def _nvml_reader(device: torch.device):
    """A function reading this GPU's energy counter (joules), or the reason there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # millijoules since the driver loaded
    except ImportError:
        return "NVML not importable (pip install nvidia-ml-py)"
    except Exception as e:  # noqa: BLE001 - a GPU before Volta, a driver without the counter
        return f"the GPU's energy counter cannot be read ({type(e).__name__}: {e})"
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


class _Rapl:
    """The package domains' counters (microjoules, wrapping at max_energy_range_uj) as one growing total."""

    def __init__(self, domains: list[str]):
        self.domains = domains
        self.ranges = [_read_int(os.path.join(d, "max_energy_range_uj")) for d in domains]
        self.last = self._raw()
        self.total_uj = 0

    def _raw(self) -> list[int]:
        return [_read_int(os.path.join(d, "energy_uj")) for d in self.domains]

    def __call__(self) -> float:
        now = self._raw()
        self.total_uj += sum((n - p) % r for n, p, r in zip(now, self.last, self.ranges))
        self.last = now
        return self.total_uj / 1e6


def _rapl_reader(local_rank: int):
    if local_rank != 0:
        return None  # the node's first rank counts the whole node's packages
    domains = sorted(d for d in glob.glob(os.path.join(RAPL, "intel-rapl:*")) if d.count(":") == 1)
    if not domains:
        return f"no RAPL counters in {RAPL} (not an Intel/AMD host exposing powercap, or a container without it)"
    try:
        return _Rapl(domains)
    except (OSError, ValueError) as e:
        return f"the RAPL counters in {RAPL} cannot be read ({e.strerror or e}; they are root-only on recent kernels)"


class EnergyMeter:
    """Collective at logged steps (`after_step(tokens, logged)`): every rank reads its source and the joules are summed.
    `source`: "nvml", "rapl" or None, with `absent` saying why."""

    def __init__(self, device: torch.device, local_rank: int, start_tokens: int = 0, price_per_kwh: float | None = None,
                 co2_g_per_kwh: float | None = None):
        """`start_tokens`: the run's tokens when this session starts (a resumed run's are not this session's)."""
        self.price, self.co2 = price_per_kwh, co2_g_per_kwh
        reader = _nvml_reader(device) if device.type == "cuda" else _rapl_reader(local_rank)
        self._read = reader if callable(reader) else None
        mine = (1 if device.type == "cuda" else 2) if self._read else 0
        missing = int(reader is not None and not callable(reader))  # (RAPL: only a node's first rank reads)
        # Agreed by every rank: a source counts only where every GPU (NVML) or node (RAPL) has it.
        kind, missing = map(int, all_reduced([mine, missing], "max"))
        self.absent = reader if isinstance(reader, str) else ("a rank or node without it" if missing else None)
        self.source = None if missing else {0: None, 1: "nvml", 2: "rapl"}[kind]
        if self.source is None:
            self._read = None
        self._start = self._read() if self._read else 0.0
        self.total_j, self._tokens0 = 0.0, start_tokens
        self._tokens_at, self._j_at = start_tokens, 0.0

    def after_step(self, tokens: int, logged: bool) -> dict:
        """On logged steps (the same on every rank): the joules so far and per token since the last logged step."""
        if not logged or self.source is None:
            return {}
        mine = self._read() - self._start if self._read else 0.0
        self.total_j = all_reduced([mine], "sum")[0]
        out = {"energy_j": self.total_j}
        if tokens > self._tokens_at:
            out["joules_per_token"] = (self.total_j - self._j_at) / (tokens - self._tokens_at)
        self._tokens_at, self._j_at = tokens, self.total_j
        return out

    def summary(self) -> dict:
        """For result.json: this session's energy up to its last logged step (no collective: also after a
        failure)."""
        if self.source is None:
            return {"source": None, "absent": self.absent or "no energy counter on this device"}
        kwh, tokens = self.total_j / 3.6e6, self._tokens_at - self._tokens0
        out = {"source": self.source, "joules": round(self.total_j, 3), "kwh": kwh,
               "joules_per_token": self.total_j / tokens if tokens else None}
        if self.price is not None:
            out["cost"] = kwh * self.price
        if self.co2 is not None:
            out["co2_kg"] = kwh * self.co2 / 1e3
        return out
