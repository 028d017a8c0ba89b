"""Process measurements: peak RSS (VmHWM) reset and sampling, I/O and CPU counters, waiting for a quiet machine."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self


from .spec import GB, KiB


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * KiB
    return out


class RssSampler(threading.Thread):
    """Samples RssAnon/RssFile every ``interval`` s: VmHWM is exact but cannot tell anonymous memory from
    file pages mapped by ``mmap`` (page cache, reclaimable), so the split of the peak is sampled."""

    def __init__(self, interval: float = 0.01) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.interval = interval
        self.stop_event = threading.Event()
        self.max_anon = 0
        self.max_file = 0

    def run(self) -> None:
        while True:
            st = proc_status()
            self.max_anon = max(self.max_anon, st.get("RssAnon", 0))
            self.max_file = max(self.max_file, st.get("RssFile", 0))
            if self.stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        self.stop_event.set()
        self.join()
        st = proc_status()
        self.max_anon = max(self.max_anon, st.get("RssAnon", 0))
        self.max_file = max(self.max_file, st.get("RssFile", 0))


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_io() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def _cpu_stat() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / hz, total / hz


class CpuWindow:
    """CPU seconds used, during a window, by this process, by the machine, and by one more process."""

    def __init__(self, other_pid: int | None = None) -> None:
        self.other_pid = other_pid

    def _other(self) -> float:
        if not self.other_pid:
            return 0.0
        try:
            import psutil

            t = psutil.Process(self.other_pid).cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001
            return 0.0

    def __enter__(self) -> Self:
        import resource

        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._sys = _cpu_stat()
        self._o = self._other()
        return self

    def __exit__(self, *exc: object) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        sys_now = _cpu_stat()
        self.self_cpu = (ru.ru_utime - self._ru.ru_utime) + (ru.ru_stime - self._ru.ru_stime)
        self.machine_busy = sys_now[0] - self._sys[0]
        self.server_cpu = self._other() - self._o

    def as_dict(self) -> dict[str, float]:
        return {"cpu_self": self.self_cpu, "cpu_machine": self.machine_busy, "cpu_server": self.server_cpu}


def wait_for_quiet(max_wait: float, threshold: float = 0.35) -> float:
    """Wait (up to ``max_wait`` s) until the machine (all cores) is mostly idle; returns the last busy share."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = _cpu_stat()
        time.sleep(0.5)
        b1, t1 = _cpu_stat()
        busy = (b1 - b0) / max(t1 - t0, 1e-9)
        if busy <= threshold or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


def touched(nbytes: int) -> Any:
    """A writable, already-faulted buffer (memoryview) of ``nbytes``; keep the returned tensor alive."""
    import torch

    t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    t.fill_(1)
    return t, memoryview(t.numpy())[:nbytes]


def ru_maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def cpu_summary(ranks: list[dict[str, Any]], seconds: float, nbytes: int) -> dict[str, float]:
    """Client/server CPU per GB and the share of the machine other processes took during the run."""
    ncpu = os.cpu_count() or 1
    client = sum(r["cpu_self"] for r in ranks)
    server = ranks[0]["cpu_server"]
    others = max(0.0, ranks[0]["cpu_machine"] - client - server)
    return {
        "client_cpu_s_per_gb": client / (nbytes / GB),
        "server_cpu_s_per_gb": server / (nbytes / GB),
        "others_cpu_frac": min(1.0, others / max(seconds * ncpu, 1e-9)),
    }
