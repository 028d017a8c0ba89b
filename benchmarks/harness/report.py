"""What a result records and prints: code and machine versions, the table, the rows' derived columns."""

from __future__ import annotations

import collections
import os
import platform
import subprocess
from typing import Any

from .spec import REPO, GiB, KiB, MiB


def cmd_version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def code_version() -> dict[str, Any]:
    """The commit benchmarked, and which files of the package differ from it (work in progress)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", REPO, *a], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except Exception:  # noqa: BLE001
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "dcp_storage").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "dirty_package_files": dirty}


def machine_notes() -> dict[str, Any]:
    import fsspec
    import torch

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * KiB
    versions = {"python": platform.python_version(), "torch": torch.__version__, "fsspec": fsspec.__version__}
    for mod in ("s3fs", "aiobotocore", "aiohttp", "psutil"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    return {
        "code": code_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": round(mem / GiB, 1),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg(),
        "versions": versions,
        "node": cmd_version(["node", "--version"]),
    }


def print_machine(machine: dict[str, Any]) -> None:
    print(
        f"machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['mem_gib']} GiB, "
        f"load {machine['loadavg_at_start']}",
        flush=True,
    )


def print_checkpoint(info: dict[str, Any]) -> None:
    print(
        f"checkpoint: {info['path']}  {info['tensor_bytes'] / GiB:.2f} GiB in {len(info['spec'])} tensors, "
        f"largest {info['largest_tensor_bytes'] / MiB:.0f} MiB; files {info['file_sizes']}",
        flush=True,
    )


TORCH_REF = {"local": "torch-fs", "s3rver": "torch-fsspec"}


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Add ratio columns (to torch's reader of the same case and to the raw limit of the case group)."""
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by_case[r["case"]].append(r)
    raw_of: dict[str, float] = {}
    for r in rows:
        if r["kind"] == "raw" and r.get("gbps"):
            group = r["case"].split(" ")[0] + " " + r["case"].split(" ")[1]  # "local 1p", "local 2r", "s3rver 1p"
            raw_of[group] = r["gbps"]
    # s3 2-rank shares the server-bound ranged-GET limit of the single-process case.
    if "s3rver 1p" in raw_of:
        raw_of.setdefault("s3rver 2r", raw_of["s3rver 1p"])
    for r in rows:
        if r["kind"] != "load" or not r.get("gbps"):
            continue
        group = " ".join(r["case"].split(" ")[:2])
        if group in raw_of:
            r["vs_raw"] = r["gbps"] / raw_of[group]
            r["raw_gbps"] = raw_of[group]
        ref_name = TORCH_REF[r["case"].split(" ")[0]]
        refs = [x for x in by_case[r["case"]] if x["reader"] == ref_name and x.get("gbps")]
        if refs:
            r["vs_torch"] = r["gbps"] / refs[0]["gbps"]
            r["torch_ref"] = ref_name + (" (" + refs[0]["note"] + ")" if refs[0].get("note") else "")


def _fmt_peak(r: dict[str, Any]) -> str:
    if "peak_extra" not in r:
        return "-"
    text = f"{r['peak_extra'] / MiB:.0f}"
    if r.get("peak_file_extra", 0) > 32 * MiB:  # mmap'd file pages (page cache) are part of it
        text += f" (anon {max(r['peak_anon_extra'], 0) / MiB:.0f})"
    return text


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "reader",
        "GB/s",
        "x torch",
        "x raw",
        "peak RSS +MiB/rank",
        "requests",
        "read/needed",
        "others' CPU",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.get("error") and not r.get("gbps"):
            cells = [r["case"], r["reader"], "ERROR", "", "", "", "", "", "", r["error"]]
        else:
            cells = [
                r["case"],
                r["reader"],
                f"{r['gbps']:.3f}",
                f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-",
                f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-",
                _fmt_peak(r),
                str(r["requests"]) if "requests" in r else "-",
                f"{r['read_ratio']:.3f}" if "read_ratio" in r else "-",
                f"{r['others_cpu_frac']:.0%}" if "others_cpu_frac" in r else "-",
                "; ".join(x for x in (r.get("note") or "", r.get("error") or "") if x),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
