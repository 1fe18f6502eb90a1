"""Accelerator specs for the roofline cost model, each figure beside its public source, and the
efficiency factors that turn peak figures into step times.

Peak figures are per GPU and dense (no 2:4 sparsity). The efficiency factors of the GPUs are
unfitted defaults until a device check measures them (`costmodel.fit_efficiency`); the CPU entry's
are fitted to this machine's SmolLM2 step times. Never a measurement itself: a spec sheet.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from agentjax.errors import InvalidRequestError

TERA = 1e12
GIGA = 1e9


# The host's time per decode step, which the device waits for: the median of 256 rows x 142K-token
# contexts x 7 KV groups with the device stubbed out, measured by
#     python scripts/bench_host_step.py --steps 100 --warmup 5 --base-repo ../base
# (BENCHMARKS.md, "Host step"). Taken at a load average of 10 on 2 shared cores: rerun it on a quiet
# machine and put its median here.
HOST_STEP_S = 0.0358


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


_NVIDIA_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column; tensor figures there are with sparsity, halved here)"
_NVIDIA_HGX = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 / B300 8-GPU totals, divided by 8; sparse FP8/BF16 halved)"
_NVIDIA_GB300 = "https://www.nvidia.com/en-us/data-center/gb300-nvl72/ (72-GPU rack totals, divided by 72)"
_VERDA = "https://verda.com/blog/gb300-nvl72-architecture (per-GPU dense table: GB300, B300, B200)"
_CX8 = "ConnectX-8 SuperNIC, 800 Gb/s per GPU (HGX B300 and GB300 NVL72 pages)"
_CX7 = "ConnectX-7, 400 Gb/s per GPU (HGX H200 / B200 reference designs)"
_DGX_H200 = ("https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
             "latest/core-components.html (DGX H200: 2 TB DDR5, eight 3.84 TB U.2 NVMe drives for cache)")
_DGX_B200 = ("https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html (DGX B200: 2 TB of "
             "DIMMs, 8 x 3.84 TB U.2 NVMe data cache, PCIe Gen5 Xeon 8570)")
_HGX_B300_HOST = ("https://neocloud.kedios.io/planning-summary-reports/B300-Single-Rack-Server-Unit-Architecture.html "
                  "(an HGX B300 server: 2 x Xeon 6776P, 32 x 128 GB DDR5; Xeon 6 root ports are PCIe Gen5)")
_NVL72_RA = ("https://docs.nvidia.com/enterprise-reference-architectures/nvl72-ai-factory/latest/components.html "
             "(GB300 NVL72 compute tray: 4 GPUs, 2 Grace CPUs, 4 E1.S NVMe cache drives)")
_GEN4_NVME = ("https://flashgenius.net/guides/storage-systems-for-ai-workloads-ncp-aii-guide (PCIe Gen4 NVMe "
              "about 7 GB/s sequential read per drive, 8 drives 40-48 GB/s write); one drive per GPU")
_GEN5_NVME = ("https://www.solidigm.com/products/technology/accelerating-ai-with-high-performance-storage.html "
              "(D7-PS1010, E1.S 7.68 TB, PCIe 5.0: up to 14,500 MB/s sequential read); one drive per GPU")
_PCIE5 = "PCIe Gen5 x16: 128 GB/s bidirectional, 64 GB/s each way"
_MISSION_PRICE = ("../shared/MISSION.md results: $4.52/h for 2 B300 and $27.72/h for 12 GB300 "
                  "($36.96/h for 16 GB300), i.e. the reference system's own GPU-hour prices")



def _host_sources(memory: str, link: str, disk: str, drive: str) -> dict[str, str]:
    return {"host_memory_bytes": memory, "host_link_bw": link, "disk_bytes": disk,
            "disk_read_bw": drive, "disk_write_bw": f"{drive}; writes taken at about half the read rate"}


GPUS: dict[str, DeviceSpec] = {
    "H200": DeviceSpec(
        name="H200", bf16_flops=989 * TERA, fp8_flops=1979 * TERA, fp4_flops=1979 * TERA,
        hbm_bytes=141 * GIGA, hbm_bw=4.8 * TERA, link_bw=450 * GIGA, scaleout_bw=50 * GIGA, nvlink_domain=8,
        price_per_hour=None,
        sources={"bf16_flops": f"1,979 TFLOPS sparse / 2: {_NVIDIA_H200}",
                 "fp8_flops": f"3,958 TFLOPS sparse / 2: {_NVIDIA_H200}",
                 "fp4_flops": "Hopper has no FP4 tensor cores: FP4 weights run at the FP8 rate",
                 "hbm_bytes": f"141 GB HBM3e: {_NVIDIA_H200}", "hbm_bw": f"4.8 TB/s: {_NVIDIA_H200}",
                 "link_bw": f"NVLink 900 GB/s bidirectional, 450 GB/s each way: {_NVIDIA_H200}",
                 "scaleout_bw": _CX7, "price_per_hour": "none chosen: pass a price",
                 "nvlink_domain": f"8 GPUs on NVSwitch per HGX/DGX H200: {_DGX_H200}",
                 **_host_sources(f"2 TB per 8 GPUs: {_DGX_H200}", f"{_PCIE5} ('PCIe Gen5: 128GB/s'): {_NVIDIA_H200}",
                                 f"one 3.84 TB U.2 drive per GPU: {_DGX_H200}", _GEN4_NVME)},
        host_memory_bytes=250 * GIGA, host_link_bw=64 * GIGA, disk_bytes=3.84 * TERA, disk_read_bw=7 * GIGA,
        disk_write_bw=3.5 * GIGA),
    "B200": DeviceSpec(
        name="B200", bf16_flops=2250 * TERA, fp8_flops=4500 * TERA, fp4_flops=9000 * TERA,
        hbm_bytes=180 * GIGA, hbm_bw=7.7 * TERA, link_bw=900 * GIGA, scaleout_bw=50 * GIGA, nvlink_domain=8,
        price_per_hour=None,
        sources={"bf16_flops": f"36 PFLOPS sparse per 8 GPUs: {_NVIDIA_HGX}; 2.25 PFLOPS dense: {_VERDA}",
                 "fp8_flops": f"72 PFLOPS sparse per 8 GPUs: {_NVIDIA_HGX}; 4.5 PFLOPS dense: {_VERDA}",
                 "fp4_flops": f"72 PFLOPS dense per 8 GPUs: {_NVIDIA_HGX}; 9 PFLOPS dense: {_VERDA}",
                 "hbm_bytes": f"1.4 TB per 8 GPUs: {_NVIDIA_HGX}; 180 GB: {_VERDA}",
                 "hbm_bw": f"7.7 TB/s: {_VERDA}",
                 "link_bw": f"NVLink 5, 1.8 TB/s bidirectional per GPU: {_NVIDIA_HGX}",
                 "scaleout_bw": _CX7, "price_per_hour": "none chosen: pass a price",
                 "nvlink_domain": f"8 GPUs on 2 NVLink switches: {_DGX_B200}",
                 **_host_sources(f"2 TB per 8 GPUs: {_DGX_B200}", f"{_PCIE5}: {_DGX_B200}",
                                 f"one 3.84 TB U.2 drive per GPU: {_DGX_B200}", _GEN4_NVME)},
        host_memory_bytes=250 * GIGA, host_link_bw=64 * GIGA, disk_bytes=3.84 * TERA, disk_read_bw=7 * GIGA,
        disk_write_bw=3.5 * GIGA),
    "B300": DeviceSpec(
        name="B300", bf16_flops=2250 * TERA, fp8_flops=4500 * TERA, fp4_flops=13500 * TERA,
        hbm_bytes=270 * GIGA, hbm_bw=7.7 * TERA, link_bw=900 * GIGA, scaleout_bw=100 * GIGA, nvlink_domain=8,
        price_per_hour=2.26,
        sources={"bf16_flops": f"36 PFLOPS sparse per 8 GPUs: {_NVIDIA_HGX}; 2.25 PFLOPS dense: {_VERDA}",
                 "fp8_flops": f"72 PFLOPS sparse per 8 GPUs: {_NVIDIA_HGX}; 4.5 PFLOPS dense: {_VERDA}",
                 "fp4_flops": f"108 PFLOPS dense per 8 GPUs: {_NVIDIA_HGX} (the Verda table says 14 PFLOPS)",
                 "hbm_bytes": f"270 GB usable of 288 GB HBM3e: {_VERDA}",
                 "hbm_bw": f"7.7 TB/s: {_VERDA} (NVIDIA: 'up to 8 TB/s')",
                 "link_bw": f"NVLink 5, 1.8 TB/s bidirectional per GPU: {_NVIDIA_HGX}",
                 "scaleout_bw": _CX8, "price_per_hour": _MISSION_PRICE,
                 "nvlink_domain": f"8 GPUs per HGX B300 baseboard: {_NVIDIA_HGX}",
                 **_host_sources(f"4 TB per 8 GPUs: {_HGX_B300_HOST}", f"{_PCIE5} (the host CPU's root ports): "
                                 f"{_HGX_B300_HOST}", f"one 3.84 TB NVMe drive per GPU, as DGX B200: {_DGX_B200}",
                                 _GEN4_NVME)},
        host_memory_bytes=500 * GIGA, host_link_bw=64 * GIGA, disk_bytes=3.84 * TERA, disk_read_bw=7 * GIGA,
        disk_write_bw=3.5 * GIGA),
    "GB300": DeviceSpec(
        name="GB300", bf16_flops=2500 * TERA, fp8_flops=5000 * TERA, fp4_flops=15000 * TERA,
        hbm_bytes=279 * GIGA, hbm_bw=8.0 * TERA, link_bw=900 * GIGA, scaleout_bw=100 * GIGA, nvlink_domain=72,
        price_per_hour=2.31,
        sources={"bf16_flops": f"360 PFLOPS sparse per 72 GPUs: {_NVIDIA_GB300}; 2.5 PFLOPS dense: {_VERDA}",
                 "fp8_flops": f"720 PFLOPS sparse per 72 GPUs: {_NVIDIA_GB300}; 5 PFLOPS dense: {_VERDA}",
                 "fp4_flops": f"1,080 PFLOPS dense per 72 GPUs: {_NVIDIA_GB300}; 15 PFLOPS: {_VERDA}",
                 "hbm_bytes": f"20 TB per 72 GPUs: {_NVIDIA_GB300}; 279 GB: {_VERDA}",
                 "hbm_bw": f"576 TB/s per 72 GPUs: {_NVIDIA_GB300}; 8 TB/s: {_VERDA}",
                 "link_bw": f"130 TB/s NVLink per 72 GPUs (1.8 TB/s bidirectional each): {_NVIDIA_GB300}",
                 "scaleout_bw": _CX8, "price_per_hour": _MISSION_PRICE,
                 "nvlink_domain": f"72 GPUs in one NVLink domain: {_NVIDIA_GB300}",
                 **_host_sources(f"up to 480 GB LPDDR5X per Grace CPU, one per 2 GPUs (36 per 72 GPUs): {_NVIDIA_GB300}",
                                 "NVLink-C2C, 900 GB/s bidirectional per Grace, shared by its 2 GPUs: 225 GB/s per GPU "
                                 f"each way: {_NVIDIA_GB300}; {_VERDA}", f"one E1.S drive per GPU: {_NVL72_RA}",
                                 _GEN5_NVME)},
        host_memory_bytes=240 * GIGA, host_link_bw=225 * GIGA, disk_bytes=7.68 * TERA, disk_read_bw=14.5 * GIGA,
        disk_write_bw=7 * GIGA),
}

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
