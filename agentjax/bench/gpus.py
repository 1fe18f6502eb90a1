"""Accelerator specs for the roofline cost model (the GPUs' figures and their public sources are data,
in `gpus.toml`), and the efficiency factors that turn peak figures into step times.

Peak figures are per GPU and dense (no 2:4 sparsity). The efficiency factors of the GPUs are
unfitted defaults until a device check measures them (`costmodel.fit_efficiency`); the CPU entry's
are fitted to this machine's SmolLM2 step times. Never a measurement itself: a spec sheet.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from agentjax.errors import InvalidRequestError

TERA = 1e12
GIGA = 1e9


# The host's share of a step (scheduler, KV manager, batch building), which the device waits for.
# scripts/bench_host_step.py measures it with the device stubbed (BENCHMARKS.md, "Host step"): 2.6 ms
# median for 48 rows x 2 KV groups of 142K-token contexts, the planner's lane counts, and 35.8 ms for
# 256 rows x 7 groups (both at a load average of 10 on 2 shared cores), so 3 ms holds for the
# projections' batches and not yet for 256-row steps.
HOST_STEP_S = 0.003


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a step reaches, per cost component, plus fixed costs.

    `overlap`: True takes each component's time as max(compute, memory) (a roofline); False adds
    them (a CPU running the jnp reference kernels). `compile_s` is charged the first time a
    padded batch shape runs (a warm GPU server has every shape compiled: 0).
    """

    compute: float = 0.5  # dense and expert matmuls
    attention_compute: float = 0.5
    memory: float = 0.7  # weight reads
    kv_memory: float = 0.7  # KV, indexer and recurrent-state reads and writes
    network: float = 0.6  # collectives on NVLink or the scale-out network
    offload: float = 0.8  # KV page copies over the host link and to or from the local disk
    step_overhead_s: float = HOST_STEP_S  # the host's share of a step (scheduling, KV manager, batch)
    layer_overhead_s: float = 20e-6  # small kernels (norms, routers, rope) per layer
    collective_latency_s: float = 15e-6  # per collective call
    compile_s: float = 0.0
    # the jnp reference kernel (CPU): fixed cost of one key-block iteration of its attention loop
    loop_overhead_s: float = 0.0
    overlap: bool = True
    source: str = "unfitted defaults (a device check fits them)"

    def __post_init__(self) -> None:
        for name in ("compute", "attention_compute", "memory", "kv_memory", "network", "offload"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"efficiency {name}={getattr(self, name)} must be > 0")
        for name in ("step_overhead_s", "layer_overhead_s", "collective_latency_s", "compile_s", "loop_overhead_s"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{name}={getattr(self, name)} must be >= 0 seconds")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "Efficiency":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. Peaks in FLOP/s and bytes/s per device; `nvlink_domain` devices share
    NVLink (`link_bw`, one direction), beyond it traffic takes `scaleout_bw` (one direction).
    The KV offload tiers per device: `host_memory_bytes` of host memory over `host_link_bw` (one
    direction: PCIe or NVLink-C2C), and a local NVMe drive of `disk_bytes` read at `disk_read_bw`
    and written at `disk_write_bw` (the system's share per GPU)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float  # devices without FP4 run FP4 weights at their FP8 rate
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    scaleout_bw: float
    nvlink_domain: int
    price_per_hour: float | None  # dollars per device-hour, None: no price chosen
    sources: dict[str, str] = field(default_factory=dict)
    efficiency: Efficiency = field(default_factory=Efficiency)
    host_memory_bytes: float = 0.0
    host_link_bw: float = 0.0
    disk_bytes: float = 0.0
    disk_read_bw: float = 0.0
    disk_write_bw: float = 0.0

    def flops_for(self, weight_bytes_per_param: float) -> float:
        """Matmul peak for weights of this width (activations in BF16, FP8 or FP4 tensor cores)."""
        if weight_bytes_per_param <= 0.6:
            return self.fp4_flops
        if weight_bytes_per_param <= 1.0:
            return self.fp8_flops
        return self.bf16_flops

    def with_efficiency(self, efficiency: Efficiency) -> "DeviceSpec":
        return dataclasses.replace(self, efficiency=efficiency)


# This machine's CPU, as the engine runs SmolLM2 on it (float32, jnp reference attention). The
# peaks are round nominal numbers; the factors scale them to measured step times. The defaults
# are the fit of `scripts/validate_simulator.py` on 2026-12-01 (BENCHMARKS.md, "Planning simulator"),
# at a load average of 2.6 on the 2 shared cores; refit with --efficiency-out for today's load.
CPU = DeviceSpec(
    name="CPU", bf16_flops=100 * GIGA, fp8_flops=100 * GIGA, fp4_flops=100 * GIGA,
    hbm_bytes=16 * GIGA, hbm_bw=10 * GIGA, link_bw=10 * GIGA, scaleout_bw=10 * GIGA, nvlink_domain=1,
    price_per_hour=None, sources={"all": "nominal: the efficiency factors are fitted to this machine"},
    host_memory_bytes=8 * GIGA, host_link_bw=10 * GIGA, disk_bytes=100 * GIGA, disk_read_bw=1 * GIGA,
    disk_write_bw=0.5 * GIGA,
    efficiency=Efficiency(compute=1.93, attention_compute=1.13, memory=1e9, kv_memory=2.05, network=1.0,
                          step_overhead_s=0.0149, layer_overhead_s=0.0, collective_latency_s=0.0,
                          compile_s=0.164, overlap=False,
                          source="fitted to 14 timed SmolLM2 steps on this CPU, 2026-12-01"))


# (field, column label, divisor): the figures of the spec table, in its order.
SPEC_FIGURES = (
    ("bf16_flops", "BF16 dense, TFLOPS", TERA), ("fp8_flops", "FP8 dense, TFLOPS", TERA),
    ("fp4_flops", "FP4 dense, TFLOPS", TERA), ("hbm_bytes", "HBM, GB", GIGA), ("hbm_bw", "HBM, TB/s", TERA),
    ("link_bw", "NVLink each way, GB/s", GIGA), ("nvlink_domain", "NVLink domain, GPUs", 1),
    ("scaleout_bw", "scale-out each way, GB/s", GIGA), ("host_memory_bytes", "host memory per GPU, GB", GIGA),
    ("host_link_bw", "host link each way, GB/s", GIGA), ("disk_bytes", "local NVMe per GPU, TB", TERA),
    ("disk_read_bw", "NVMe read, GB/s", GIGA), ("disk_write_bw", "NVMe write, GB/s", GIGA),
    ("price_per_hour", "price, $ per GPU-hour", 1),
)


def _load_gpus(path: Path = Path(__file__).with_name("gpus.toml")) -> dict[str, DeviceSpec]:
    """The GPUs of `gpus.toml`: figures in the spec table's units (`SPEC_FIGURES`), sources with their
    {NAME} references filled in."""
    table = tomllib.loads(path.read_text(encoding="utf-8"))
    references = table.pop("references")
    devices = {}
    for name, entry in table.items():
        figures = {figure: entry[figure] * unit for figure, _, unit in SPEC_FIGURES if figure in entry}
        sources = {figure: text.format(**references) for figure, text in entry["sources"].items()}
        devices[name] = DeviceSpec(name=name, price_per_hour=figures.pop("price_per_hour", None),
                                   sources=sources, **figures)
    return devices


GPUS: dict[str, DeviceSpec] = _load_gpus()


def spec_table(devices: dict[str, DeviceSpec] | None = None) -> str:
    """The GPU table as Markdown: the figures per GPU, then each figure's source
    (`python scripts/gpu_specs_table.py` prints it; BENCHMARKS.md carries it)."""
    devices = GPUS if devices is None else devices

    def value(device: DeviceSpec, name: str, divisor: float) -> str:
        raw = getattr(device, name)
        if raw is None:
            return "-"
        scaled = raw / divisor
        return f"{scaled:,.0f}" if scaled >= 100 else f"{scaled:g}"

    lines = ["| figure | " + " | ".join(devices) + " |", "|---" * (len(devices) + 1) + "|"]
    for name, label, divisor in SPEC_FIGURES:
        lines.append(f"| {label} | " + " | ".join(value(d, name, divisor) for d in devices.values()) + " |")
    lines += ["", "| GPU | figure | source |", "|---|---|---|"]
    for key, device in devices.items():
        for name, label, _ in SPEC_FIGURES:
            lines.append(f"| {key} | {label} | {device.sources.get(name, '-')} |")
    return "\n".join(lines) + "\n"


def get_device(name: str, efficiency_file: str | Path | None = None) -> DeviceSpec:
    """A device by name (case-insensitive: H200, B200, B300, GB300, CPU), with its efficiency
    factors replaced by those in `efficiency_file` (a JSON object of `Efficiency` fields)."""
    key = name.upper()
    device = CPU if key == "CPU" else GPUS.get(key)
    if device is None:
        raise InvalidRequestError(f"unknown device {name!r}; known: {', '.join([*GPUS, 'CPU'])}")
    if efficiency_file is not None:
        fields = json.loads(Path(efficiency_file).read_text(encoding="utf-8"))
        device = device.with_efficiency(Efficiency.from_dict(fields.get("efficiency", fields)))
    return device
