"""benchmarks/gpu_check.py without a GPU: it finds the tree's vitlab on its own and runs the checks it is asked for,
in that order (a lease of minutes puts the ones that matter first)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, benchmark

gpu_check = benchmark("gpu_check")


def test_the_script_imports_the_tree_s_vitlab_without_it_being_installed(tmp_path):
    # a GPU machine has torch but no vitlab installed: the throughput check imports vitlab in the script's own
    # process, which failed there with ModuleNotFoundError when the tree's src was only on the children's path
    import torch
    site = str(Path(torch.__file__).parents[1])  # torch's site-packages, without its .pth files (python -S)
    code = (f"import runpy, sys; sys.path.append({site!r}); "
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_check.py')!r}, run_name='loaded'); "
            "import vitlab; print(vitlab.__file__)")
    probe = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(str(ROOT / "src" / "vitlab"))


def test_only_runs_the_named_checks_in_the_order_given(monkeypatch, capsys):
    called = []
    monkeypatch.setattr(gpu_check, "check_device_tests", lambda: called.append("tests") or "fine")
    monkeypatch.setattr(gpu_check, "check_cuda_smoke", lambda tmp, device, epochs: called.append("smoke") or "fine")
    monkeypatch.setattr(gpu_check, "check_torchrun", lambda tmp, device: called.append("torchrun") or "fine")
    monkeypatch.setattr(gpu_check, "check_cifar", lambda tmp, data, device: called.append("cifar") or "fine")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--only", "cifar", "tests"])
    assert gpu_check.main() == 0
    assert called == ["cifar", "tests"]
    table = capsys.readouterr().out
    assert "CIFAR-10 recipe" in table and "device tests" in table and "torchrun" not in table


def test_a_failed_check_is_a_row_of_the_table_and_the_exit_status(monkeypatch, capsys):
    def broken(tmp, data, device):
        raise RuntimeError("target 94% within 300 s not met: final 90.37%")
    monkeypatch.setattr(gpu_check, "check_cifar", broken)
    monkeypatch.setattr(gpu_check, "check_device_tests", lambda: "fine")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--only", "cifar", "tests"])
    assert gpu_check.main() == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("CIFAR-10 recipe ", "device "))]
    assert any("FAILED" in r and "90.37%" in r for r in rows) and any(" ok " in r for r in rows)


def test_the_throughput_check_adds_its_own_rows_and_fails_like_any_other(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check, "check_throughput",
                        lambda peak, names, steps: [(f"{n} train eager", "ok", f"{peak:.0f} peak") for n in names])
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--only", "throughput", "--models", "vit_a", "vit_b"])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert "vit_a train eager: ok 989 peak" in out and "vit_b train eager: ok 989 peak" in out

    def broken(peak, names, steps):
        raise ModuleNotFoundError("No module named 'vitlab'")
    monkeypatch.setattr(gpu_check, "check_throughput", broken)
    assert gpu_check.main() == 1
    assert "throughput: FAILED No module named 'vitlab'" in capsys.readouterr().out
