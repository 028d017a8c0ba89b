"""Run one benchmark on two versions of the code in one session, alternating, and compare their rows.

A refactor that "changes no behaviour" must also change no speed. Two runs on different days differ by more
than the change under test (page cache, load, thermal state), so both versions run here, interleaved round
by round, on the same data and machine::

    python benchmarks/compare_versions.py --before 839628c --rounds 2 -- bench_dcp_read.py --size-gib 0.5

``--before`` is any git ref; it is checked out into a temporary worktree (the built C extension is copied
in when the ref's tree has the same source), and its own copy of the benchmark runs against its own package
(``PYTHONPATH``). Each run writes its JSON; the rows (``rows``/``write_rows``/``results``, keyed by case and
reader or writer) are matched, and the best GB/s of each version is printed with the ratio after/before. The
comparison goes to ``benchmarks/results/compare-<bench>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = Path("dcp_storage/formats/dcp_native")
ROW_LISTS = ("rows", "write_rows", "results")


def _worktree(ref: str, where: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(where), ref], cwd=ROOT, check=True)
    for built in (ROOT / EXTENSION).glob("_metadata_decode*.so"):
        source = ROOT / EXTENSION / "_metadata_decode.c"
        theirs = where / EXTENSION / "_metadata_decode.c"
        if theirs.exists() and theirs.read_bytes() == source.read_bytes():
            shutil.copy2(built, where / EXTENSION / built.name)
    # Its own entry points (the built-in formats' registry entries moved between versions): an egg-info in the
    # tree, which importlib.metadata finds before the installed distribution (PYTHONPATH comes first).
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info"], cwd=where, check=True, capture_output=True)
    return where


def _run(tree: Path, bench: str, args: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / bench), *args, "--json", str(out)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def _rows(result: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    found: dict[tuple[str, str, str], float] = {}
    for kind in ROW_LISTS:
        for row in result.get(kind) or []:
            if not isinstance(row, dict) or not isinstance(row.get("gbps"), (int, float)):
                continue
            who = str(row.get("reader") or row.get("writer") or row.get("name") or "")
            key = (kind, str(row.get("case", "")), who)
            found[key] = max(found.get(key, 0.0), float(row["gbps"]))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="git ref of the earlier version")
    p.add_argument("--rounds", type=int, default=2, help="alternations of before/after (default 2)")
    p.add_argument("bench", help="benchmark script name in benchmarks/ (e.g. bench_dcp_read.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (after --)")
    ns = p.parse_args(argv)
    args = [a for a in ns.args if a != "--"]
    best: dict[str, dict[tuple[str, str, str], float]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="compare-versions-") as tmp:
        before = _worktree(ns.before, Path(tmp) / "before")
        try:
            trees = {"before": before, "after": ROOT}
            for round_ in range(ns.rounds):
                order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
                for label in order:
                    rows = _rows(_run(trees[label], ns.bench, args, Path(tmp) / f"{label}-{round_}.json"))
                    for key, gbps in rows.items():
                        best[label][key] = max(best[label].get(key, 0.0), gbps)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    table = []
    print(f"\n{'rows':<10} {'case':<28} {'reader/writer':<28} {'before':>8} {'after':>8} {'after/before':>12}")
    for key in sorted(set(best["before"]) & set(best["after"])):
        b, a = best["before"][key], best["after"][key]
        ratio = a / b if b else float("nan")
        table.append({"rows": key[0], "case": key[1], "who": key[2], "before_gbps": b, "after_gbps": a, "ratio": ratio})
        print(f"{key[0]:<10} {key[1][:28]:<28} {key[2][:28]:<28} {b:>8.3f} {a:>8.3f} {ratio:>12.3f}")
    out = ROOT / "benchmarks" / "results" / f"compare-{Path(ns.bench).stem}.json"
    load = os.getloadavg()
    out.write_text(
        json.dumps(
            {
                "before": ns.before,
                "bench": ns.bench,
                "args": args,
                "rounds": ns.rounds,
                "loadavg_at_end": load,
                "rows": table,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out} (load average at end {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
