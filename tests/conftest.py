import hashlib
import importlib.util
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import vitlab
from vitlab.cli import main
from vitlab.data import load_data
from vitlab.runs.folder import LOCK

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VITLAB_SHARED", ROOT.parent / "shared"))
PARITY = SHARED / "parity"

# Under pytest-xdist (`make test` runs one worker per core) each worker keeps to one thread, and so do the commands
# it starts (OMP_NUM_THREADS): two workers each spreading tiny ops over every core would only wait on each other.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1 if WORKER else min(2, os.cpu_count() or 1))


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a torchrun rendezvous: tests that run side by side never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test, restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private vitlab cache for the test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("VITLAB_CACHE", str(d))
    return d


class Ran(NamedTuple):
    """What one command line run in this process did."""

    code: int
    err: str  # stderr, stripped
    out: str  # stdout

    @property
    def lines(self) -> list[str]:
        return self.err.splitlines()


def run_cli(capsys, argv) -> Ran:
    """Run the CLI in this process (argparse's exit included), asserting that no traceback reached stderr."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    ran = Ran(code, captured.err.strip(), captured.out)
    assert "Traceback" not in ran.err, ran.err
    return ran


def error_line(capsys, argv, code: int = 2, *, after_log: bool = False) -> str:
    """The one line a command ends with when it fails: exit ``code``, ``vitlab COMMAND: ...`` alone on stderr (with
    ``after_log``, log and progress lines may come before it, none of them an error), no traceback."""
    ran = run_cli(capsys, argv)
    lines = ran.lines
    assert ran.code == code and lines, ran
    assert len(lines) == 1 or after_log, lines
    assert lines[-1].startswith(f"vitlab {argv[0]}: ") and not any(": error: " in line for line in lines[:-1]), lines
    assert code != 2 or ": error: " in lines[-1], lines
    return lines[-1]


def benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py freshly imported as the module NAME (with benchmarks/ on the path, as when it runs)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def stop_at_checkpoint(monkeypatch, k: int) -> None:
    """The next run stops (as if killed) right after its k-th checkpoint (within an epoch or at its end) is written."""
    from vitlab.train import setup as run_setup
    real, saved = run_setup.save_checkpoint, []

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        saved.append(1)
        if len(saved) == k:
            raise KeyboardInterrupt
    monkeypatch.setattr(run_setup, "save_checkpoint", save_then_stop)  # Run.checkpoint's writer


def quiet_load(source, **kw):
    """``load_data`` with its log kept: (bundle, log lines)."""
    logs = []
    return load_data(str(source), log=logs.append, **kw), logs


def checksums(folder) -> dict[str, str]:
    """{path relative to ``folder``: sha256} of every file under it, the lock vitlab holds while it writes a folder
    aside: what a user had, to compare after a command."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK}


@dataclass(frozen=True)
class Family:
    """One registered model family, made small for the CPU: the row every per-family test runs over."""

    id: str
    name: str  # a registered name of the family
    args: dict[str, Any]  # overrides that keep it small (32x32 RGB input)
    attention: tuple[str, ...]  # the kinds of its attention blocks, input to output; () for a CNN
    timm: bool  # exports to a timm folder (else a one-line error says what timm lacks)
    hf: bool  # exports to a transformers folder

    def create(self, **overrides: Any) -> nn.Module:
        return vitlab.create_model(self.name, **{**self.args, **overrides})


FAMILIES = (
    Family("vit", "vit_tiny_patch4_32", dict(embed_dim=32, depth=2, num_heads=2), ("mhsa",) * 2, timm=True, hf=True),
    Family("vit_avg", "vit_tiny_avg_patch4_32", dict(embed_dim=32, depth=2, num_heads=2, init_values=0.1),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("deit", "deit_tiny_distilled_patch4_32", dict(embed_dim=32, depth=2, num_heads=2), ("mhsa",) * 2,
           timm=True, hf=True),
    Family("convit", "convit_tiny_patch4_32", dict(embed_dim=8, depth=3, num_heads=4, local_up_to_layer=2),
           ("gpsa", "gpsa", "mhsa"), timm=True, hf=False),
    Family("cait", "cait_xxs_patch4_32", dict(embed_dim=32, depth=2, num_heads=2, depth_token_only=1),
           ("talking_heads", "talking_heads", "class_attn"), timm=True, hf=False),
    Family("hybrid", "vit_tiny_r18_32", dict(embed_dim=32, depth=2, num_heads=2, backbone_layers=(1, 1),
                                             backbone_widths=(8, 16)), ("mhsa",) * 2, timm=False, hf=False),
    Family("hybrid_resnetv2", "vit_tiny_r_s16_p8_224", dict(img_size=32, patch_size=1, embed_dim=32, depth=2,
                                                           num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("mixer", "mixer_s16_224", dict(img_size=32, patch_size=4, num_blocks=2, embed_dim=32, num_classes=10), (),
           timm=True, hf=False),
    Family("cct", "cct_7_3x2_32", dict(embed_dim=32, depth=2, num_heads=2, tokenizer_width=8), ("mhsa",) * 2,
           timm=False, hf=False),
    Family("deit3", "deit3_small_patch16_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                    num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("dinov2_reg4", "vit_small_patch14_reg4_dinov2", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("clip", "vit_base_patch16_clip_quickgelu_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                               num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("siglip", "vit_base_patch16_siglip_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                         num_heads=2, num_classes=10), ("mhsa", "mhsa", "attn_pool"),
           timm=True, hf=False),
    Family("vit_options", "vit_tiny_patch4_32", dict(embed_dim=32, depth=2, num_heads=2, qk_norm=True, proj_bias=False,
                                                     final_norm=False, global_pool="avg", act_layer="swish"),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("beit", "beit_base_patch16_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                 num_classes=10), ("mhsa",) * 2, timm=True, hf=True),
    Family("beit_shared", "beit_base_patch16_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                        num_classes=10, global_pool="token", use_abs_pos_emb=True,
                                                        use_rel_pos_bias=False, use_shared_rel_pos_bias=True),
           ("mhsa",) * 2, timm=True, hf=True),
    Family("eva02", "eva02_tiny_patch14_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                   num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("dinov3", "vit_small_plus_patch16_dinov3_qkvb", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                num_heads=2, num_classes=10, init_values=0.1),
           ("mhsa",) * 2,
           timm=True, hf=False),  # transformers' DINOv3ViTModel has no classifier head
    Family("rope_mixed", "vit_small_patch16_rope_mixed_ape_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                      num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("naflex_siglip", "naflexvit_base_patch16_siglip", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                  num_heads=2, num_classes=10,
                                                                  pos_embed_grid_size=(8, 8)),
           ("mhsa", "mhsa", "attn_pool"), timm=True, hf=False),
    Family("pe_core", "vit_pe_core_tiny_patch16_384", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                           num_heads=2, num_classes=10), ("mhsa", "mhsa", "attn_pool"),
           timm=True, hf=False),
    Family("vit_xp", "vit_base_patch16_xp_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                     num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("dinov2_giant", "vit_giant_patch14_reg4_dinov2", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                 num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("eva_post_norm", "eva02_enormous_patch14_clip_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                                    num_heads=2, num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("sapiens2", "vit_base_patch16_sapiens2", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                                                         num_kv_heads=(4, 2), num_classes=10), ("mhsa",) * 2,
           timm=True, hf=False),
    Family("aimv2", "aimv2_large_patch14_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                    num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("qwen3", "qwen3_vit_88m", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                          pos_embed_grid_size=4, num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("qwen3_merge", "qwen3_vit_88m_merge", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                      pos_embed_grid_size=4, out_features=16, num_classes=10),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("gemma4", "gemma4_vit_167m", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, head_dim=16,
                                             intermediate_size=64, position_embedding_size=16, num_classes=10),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("gemma4_soft", "gemma4_vit_570m", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                  head_dim=16, intermediate_size=64, position_embedding_size=16,
                                                  pooling_kernel_size=2, encoder_pool="soft", num_classes=10),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("deepseek", "deepseek_vit_412m", dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                                 num_classes=10), ("mhsa",) * 2, timm=True, hf=False),
    Family("deepseek_align", "deepseek_vit_412m_align", dict(img_size=32, patch_size=4, embed_dim=32, depth=2,
                                                             num_heads=2, out_features=16, num_classes=10),
           ("mhsa",) * 2, timm=True, hf=False),
    Family("resnet", "resnet10_32", dict(widths=(8, 16, 32, 64)), (), timm=False, hf=False),  # CIFAR stem: not timm's
    Family("airbench", "airbench_32", dict(widths=(8, 16, 16)), (), timm=False, hf=False),
    Family("airbench_hybrid", "vit_nano_airbench_32", dict(stem_widths=(8, 16, 16), stem_pad=False, embed_dim=32,
                                                           depth=2, num_heads=2), ("mhsa",) * 2, timm=False, hf=False),
)
FAMILY = {f.id: f for f in FAMILIES}
ATTENTION_FAMILIES = [f.id for f in FAMILIES if f.attention]


# A test is slow when its own mark says so (subprocesses, torchrun, a browser) or when it took more than
# SLOW_SECONDS in the last recorded run of the whole set (tests/durations.json, written by `make durations`), so
# that `make test` stays a few minutes as tests grow; `make test-all` (CI) runs every test either way.
DURATIONS = Path(__file__).with_name("durations.json")
SLOW_SECONDS = 2.0


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="FILE", default=None,
                     help="write each test's seconds (setup + call + teardown) to FILE as durations.json's format")


def pytest_collection_modifyitems(config, items):
    recorded = json.loads(DURATIONS.read_text())["seconds"] if DURATIONS.is_file() else {}
    for item in items:
        if recorded.get(item.nodeid, 0.0) > SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


class _Durations:
    """Sums the seconds of each test's phases as their reports arrive (on the controller under xdist)."""

    def __init__(self, path: str, machine: str):
        self.path, self.machine, self.seconds = Path(path), machine, {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if getattr(session.config, "workerinput", None) is not None:
            return  # an xdist worker: the controller writes
        kept = {k: round(v, 2) for k, v in sorted(self.seconds.items()) if v >= 0.5}
        self.path.write_text(json.dumps({"machine": self.machine, "seconds": kept}, indent=0) + "\n")


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path and getattr(config, "workerinput", None) is None:
        import platform
        config.pluginmanager.register(_Durations(path, f"{platform.processor() or platform.machine()}, "
                                                       f"{os.cpu_count()} cores"), "vitlab-durations")
