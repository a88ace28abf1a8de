"""CPU time spent by a benchmark's processes, read from /proc (Linux only).

On a machine whose cores are all busy, throughput follows the CPU each run costs across
every process involved (the worker's, the database's, the broker's), so a benchmark that
reports where the CPU went says where a faster run has to find its time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def process_seconds(pid: int) -> float:
    """User plus system CPU seconds of one process so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command's closing parenthesis: state is field 0, utime 11 and stime 12.
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (summed over its cores)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle and iowait
    return (sum(values[:8]) - idle) / TICKS


class CpuMeter:
    """CPU seconds per group of processes between `start()` and `stop()`. Each group is
    a function returning its pids, asked at both ends (processes that end between are
    not counted; a benchmark's servers and workers live through the measure)."""

    def __init__(self, groups: Mapping[str, Callable[[], list[int]]]) -> None:
        self._groups = groups
        self._start: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        seen = {
            name: sum(process_seconds(pid) for pid in pids()) for name, pids in self._groups.items()
        }
        seen["machine"] = machine_busy_seconds()
        return seen

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {name: end[name] - self._start[name] for name in end}
