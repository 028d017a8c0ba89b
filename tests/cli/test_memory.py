"""``convert`` holds about one tensor, not the checkpoint: peak RSS of a child converting ~200 MB."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ._helpers import REPO, cli_env

MiB = 1024 * 1024
LARGEST = 20 * MiB
BASELINE_SLACK = 40 * MiB  # allocator, thread stacks, the reader's header probes, small tensors

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from dcp_storage.cli import main

    src, out, tiny = sys.argv[1], sys.argv[2], sys.argv[3]

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    def reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS (Linux >= 4.0)
            f.write("5")

    # Warm up: the first convert imports safetensors/fsspec bits and starts the I/O thread pool.
    assert main(["convert", tiny, out + "/warm.pt"]) == 0
    base = status("VmRSS")
    figures = {"baseline_rss": base, "steps": {}}
    for name, argv in [
        ("dcp->safetensors", ["convert", src, out + "/big.safetensors"]),
        ("dcp->torch", ["convert", src, out + "/big.pt"]),
        ("safetensors->dcp", ["convert", out + "/big.safetensors", out + "/big_dcp", "--to", "dcp"]),
        ("torch->safetensors bf16", ["convert", out + "/big.pt", out + "/big2.safetensors", "--dtype", "bf16"]),
        ("verify --deep", ["verify", out + "/big.pt", "--deep"]),
    ]:
        reset_peak()
        before = status("VmRSS")
        rc = main(argv)
        figures["steps"][name] = {"rc": rc, "peak_growth": status("VmHWM") - before}
    # ru_maxrss counts the pages this process had when forked from the (big) test process, so the
    # per-step high-water marks above are the figures; ru_maxrss is reported for reference.
    figures["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures["max_peak_growth"] = max(s["peak_growth"] for s in figures["steps"].values())
    print(json.dumps(figures))
    """
)


def test_convert_peak_rss_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter

    src, out = tmp_path / "big_dcp", tmp_path / "out"
    out.mkdir()
    n = LARGEST // 4
    state = {f"layer{i}.weight": torch.full((n // 1000, 1000), float(i)) for i in range(9)}  # 9 x 20 MiB
    state["layer9.weight"] = torch.arange(n, dtype=torch.float32)  # a 20 MiB tensor with distinct values
    state.update({f"small{i}": torch.randn(1000, 100) for i in range(20)})  # 20 x 400 KB
    dcp.save(state, storage_writer=FsspecWriter(src), no_dist=True)
    dcp.save({"t": torch.ones(3)}, storage_writer=FsspecWriter(tmp_path / "tiny"), no_dist=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    del state
    assert total > 200 * 1000 * 1000

    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), str(tmp_path / "tiny")],
        check=False,
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        "peak RSS figures (MiB):",
        json.dumps(
            {
                "checkpoint": round(total / MiB, 1),
                "largest_tensor": LARGEST / MiB,
                "baseline_rss": round(figures["baseline_rss"] / MiB, 1),
                **{k: round(v["peak_growth"] / MiB, 1) for k, v in figures["steps"].items()},
            }
        ),
    )
    assert all(s["rc"] == 0 for s in figures["steps"].values()), figures
    assert figures["max_peak_growth"] < 3 * LARGEST + BASELINE_SLACK, figures

    from safetensors import safe_open

    with safe_open(str(out / "big2.safetensors"), "pt") as f:  # and the data made it through every hop
        want = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)
        assert torch.equal(f.get_tensor("layer9.weight"), want)
        assert f.get_slice("layer3.weight")[0, :3].tolist() == [3.0, 3.0, 3.0]
