"""What CPU this is, for logs and benchmark tables: its model name, its feature flags, and a
one-line summary of the SIMD features our kernels and torch's care about (AVX-512, its BF16 /
VNNI extensions, AMX, AVX2) with the level torch picked (`ATEN_CPU_CAPABILITY` may lower it;
our kernels' build follows it); and how much memory this process may still use (the CPU KV
pool's default size)."""

from __future__ import annotations

import platform
import re
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max, memory.current
FEATURES = {  # /proc/cpuinfo flag -> the name tables use
    "avx512f": "AVX-512",
    "avx512_bf16": "BF16",
    "avx512_vnni": "VNNI",
    "amx_tile": "AMX",
    "avx2": "AVX2",
}


def _cpuinfo_field(name: str, cpuinfo: Path) -> str | None:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    match = re.search(rf"^{name}\s*:(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """E.g. 'AMD EPYC 9R14 96-Core Processor'; the platform's word where Linux does not say."""
    return _cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    return set((_cpuinfo_field("flags", cpuinfo) or "").split())


def describe_cpu() -> str:
    """E.g. 'Intel(R) Xeon(R) Processor (AVX-512, BF16, VNNI, AMX, AVX2; torch level AVX512)'."""
    flags = cpu_flags()
    present = [name for flag, name in FEATURES.items() if flag in flags] or ["no AVX2"]
    import torch  # here: the bench's report imports this module without needing torch

    level = torch.backends.cpu.get_cpu_capability()
    return f"{cpu_model()} ({', '.join(present)}; torch level {level})"


def available_memory_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, within what the cgroup's
    limit leaves (memory.max - memory.current, cgroup v2: containers); None where neither
    can be read."""
    found = []
    match = re.search(r"^MemAvailable:\s+(\d+) kB", _read(meminfo) or "", re.MULTILINE)
    if match:
        found.append(int(match.group(1)) * 1024)
    limit, current = _read(cgroup / "memory.max"), _read(cgroup / "memory.current")
    if limit and current and limit.strip().isdigit() and current.strip().isdigit():
        found.append(max(int(limit) - int(current), 0))
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


GiB = 1 << 30


def free_memory_bytes(device) -> int | None:
    """Memory a new tensor on `device` (a torch.device) may still take: on CPU
    `available_memory_bytes`, on CUDA the GPU's free memory; None where unknown."""
    if device.type == "cpu":
        return available_memory_bytes()
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    return None


def check_fits(nbytes: int, device, what: str, remedy: str) -> None:
    """ValueError, before a tensor of `nbytes` is allocated, where it cannot fit in what is free
    on `device`: `what` (the tensor, with the flag that sized it) and `remedy` name the flag.
    Allocating it instead fails in torch (an unnamed RuntimeError) or, on Linux, succeeds
    lazily and gets the process killed once its pages are touched."""
    free = free_memory_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"{what} takes {nbytes / GiB:.1f} GiB, more than the {free / GiB:.1f} GiB free on "
            f"{device}; {remedy}"
        )
