"""The accelerators a run plans for: a spec such as `8xH100-80GB`, or the devices of this host.

Read without starting JAX (its backend would preallocate GPU memory before the plan sets the
allocator): GPUs through `nvidia-smi` / `rocm-smi`, else the CPU (its cores and memory). A spec's
memory is the datasheet's, in GB of 1e9 bytes (an H100 80GB is 80e9 here, while its driver reports
85.5e9): every plan made from a spec keeps that difference as slack.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

GB = 1e9
DRIVER_HEADROOM = 0.94
# Names by vendor; the vendor decides the variable that pins a server to its devices.
NVIDIA = ("H100", "H200", "H800", "H20", "A100", "A800", "L40S", "L40", "L4", "B200", "B300", "GB200", "RTX")
AMD = ("MI210", "MI250", "MI250X", "MI300A", "MI300X", "MI308X", "MI325X", "MI355X")
VISIBLE_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}
SPEC_RE = re.compile(r"^(\d+)x([A-Za-z0-9]+?)(?:-(\d+(?:\.\d+)?)GB)?$")
EXAMPLES = "8xH100-80GB, 8xH200-141GB, 8xMI300X-192GB, 1xH100-80GB, 1xCPU-24GB"


class DeviceSpecError(ValueError):
    """A --plan-devices spec that cannot be read; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Devices:
    count: int  # accelerators (a CPU host: 1)
    name: str  # "H100", "MI300X", "CPU"
    vendor: str  # "nvidia", "amd" or "cpu"
    bytes_per_device: float  # memory per accelerator (a CPU host: its RAM)
    cpu_cores: int = 0  # a CPU host's cores (vLLM CPU servers are pinned to them)
    source: str = "spec"  # "spec" or how this host was read

    @property
    def usable_bytes(self) -> float:
        """What a plan may fill: a spec's datasheet figure (already below the driver's), or 94% of what
        the driver reports (its own reservations, CUDA contexts a plan does not count)."""
        return self.bytes_per_device * (1.0 if self.source == "spec" or not self.is_gpu else DRIVER_HEADROOM)

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def visible_env(self) -> str | None:
        return VISIBLE_ENV.get(self.vendor)

    def describe(self) -> str:
        return f"{self.count}x{self.name}-{self.bytes_per_device / GB:.0f}GB ({self.vendor}, {self.source})"


def vendor_of(name: str) -> str | None:
    upper = name.upper()
    if upper == "CPU":
        return "cpu"
    if any(upper.startswith(n) for n in AMD) or upper.startswith("MI"):
        return "amd"
    if any(upper.startswith(n) for n in NVIDIA):
        return "nvidia"
    return None


def parse_spec(spec: str) -> Devices:
    """`8xH100-80GB` -> 8 NVIDIA devices of 80e9 bytes; `1xCPU-24GB` a CPU host of 24e9 bytes."""
    m = SPEC_RE.match(spec.strip())
    if not m:
        raise DeviceSpecError(f"--plan-devices {spec!r}: expected COUNTxNAME-MEMGB, e.g. {EXAMPLES}")
    count, name, mem = int(m.group(1)), m.group(2), m.group(3)
    vendor = vendor_of(name)
    if vendor is None:
        raise DeviceSpecError(
            f"--plan-devices {spec!r}: unknown device {name!r} (NVIDIA: {', '.join(NVIDIA)}; AMD: {', '.join(AMD)}; or CPU)"
        )
    if count <= 0 or count > 4096:
        raise DeviceSpecError(f"--plan-devices {spec!r}: the count must be 1..4096")
    if mem is None:
        raise DeviceSpecError(f"--plan-devices {spec!r}: give the memory per device, e.g. {count}x{name}-80GB")
    if vendor == "cpu" and count != 1:
        raise DeviceSpecError(f"--plan-devices {spec!r}: a CPU host is one device (1xCPU-MEMGB)")
    return Devices(count, name.upper(), vendor, float(mem) * GB, cpu_cores=os.cpu_count() or 1)


def _query(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _nvidia() -> Devices | None:
    text = _query(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    rows = [line.rsplit(",", 1) for line in (text or "").strip().splitlines() if "," in line]
    if not rows:
        return None
    name = rows[0][0].strip().replace("NVIDIA ", "").split()[0]
    mib = min(float(r[1]) for r in rows)
    return Devices(len(rows), name, "nvidia", mib * 2**20, os.cpu_count() or 1, "nvidia-smi")


def _amd() -> Devices | None:
    text = _query(["rocm-smi", "--showmeminfo", "vram", "--csv"])
    rows = [line.split(",") for line in (text or "").strip().splitlines()[1:] if line.startswith("card")]
    if not rows:
        return None
    total = min(float(r[1]) for r in rows)  # "VRAM Total Memory (B)"
    product = re.search(r"MI\d+[A-Z]*", _query(["rocm-smi", "--showproductname"]) or "")
    return Devices(len(rows), product.group(0) if product else "AMD", "amd", total, os.cpu_count() or 1, "rocm-smi")


def _host_memory() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GB


def local_devices() -> Devices:
    """This host's GPUs, or its CPU (what JAX and vLLM would run on here)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.strip() != "cpu":
        found = _nvidia() or _amd()
        if found is not None:
            return found
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Devices(1, "CPU", "cpu", _host_memory(), cores, "this host")
