"""Peak memory of one measurement: the process's peak RSS on CPU, the allocator's peak on CUDA.

No psutil: on Linux the peak RSS is `VmHWM` in /proc/self/status, and writing "5" to
/proc/self/clear_refs resets it to the current RSS (Linux >= 4.0), so each measurement gets its own
peak. Where that reset is refused (or there is no /proc, e.g. macOS), the figure is the process's
lifetime peak from `resource.getrusage`, and `resettable` says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # clear_refs command: reset the peak RSS (VmHWM) to the current RSS


class PeakMemory(Protocol):
    """Resets a peak-memory counter before a measurement and reads it after."""

    @property
    def kind(self) -> str:
        """What is measured, for reports ("peak RSS", "CUDA max allocated")."""
        ...

    @property
    def resettable(self) -> bool:
        """False when `reset` could not clear the counter (the peak then covers the process's lifetime)."""
        ...

    def reset(self) -> None: ...

    def peak_bytes(self) -> int: ...


def _status_kib(field: str) -> int | None:
    """A `kB` field of /proc/self/status (e.g. VmHWM), or None where there is no such file or field."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0])
    return None


def _lifetime_peak_rss() -> int:
    import resource  # POSIX only: imported here so that importing this module works everywhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


@dataclass
class ProcessPeakRss:
    """Peak resident set size of this process, in bytes (model weights and everything else included)."""

    resettable: bool = True

    @property
    def kind(self) -> str:
        return "peak RSS"

    def reset(self) -> None:
        try:
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
        except OSError:
            self.resettable = False

    def peak_bytes(self) -> int:
        peak_kib = _status_kib("VmHWM") if self.resettable else None
        return peak_kib * 1024 if peak_kib is not None else _lifetime_peak_rss()


@dataclass
class CudaPeakAllocated:
    """`torch.cuda.max_memory_allocated` on one device: tensors only, not the allocator's cache or context."""

    device: torch.device
    resettable: bool = True

    @property
    def kind(self) -> str:
        return "CUDA max allocated"

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


# Device type -> how its peak is measured; any other device falls back to the process's peak RSS.
PEAK_MEMORY: dict[str, Callable[[torch.device], PeakMemory]] = {
    "cuda": CudaPeakAllocated,
    "cpu": lambda device: ProcessPeakRss(),
}


def peak_memory_for(device: torch.device) -> PeakMemory:
    """The peak-memory counter that fits a model on `device`."""
    factory = PEAK_MEMORY.get(device.type)
    return factory(device) if factory is not None else ProcessPeakRss()


def peak_tensor_bytes(run: Callable[[], object]) -> int:
    """The most bytes torch's CPU allocator held at once while `run` ran, counted from its start.

    From torch's own allocation records (`torch.profiler` with ``profile_memory``: every allocation and free, in
    order), so the figure is exact and free of the process heap's noise; only what `run` allocates counts, and a
    tensor allocated before it is seen when freed only if `run` allocated it.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
