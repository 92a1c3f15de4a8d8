"""vitlab.analysis: attention capture, rollout, distances, embeddings, figures and `vitlab inspect`."""
import argparse
import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ATTENTION_FAMILIES, FAMILY, PARITY
from matplotlib.text import Text
from PIL import Image

import vitlab
from vitlab.analysis import (
    AttentionMap,
    attention_distance,
    attention_maps,
    capture_attention,
    convit_gates,
    embedding_filters,
    grad_rollout,
    mean_attention_distance,
    patch_distances,
    plots,
    position_similarity,
    positional_attention_distance,
    rollout,
)
from vitlab.cli import inspect as command
from vitlab.errors import VitlabError

TINY = {f: FAMILY[f] for f in ATTENTION_FAMILIES}  # every family with attention, small enough for the CPU


def tiny(family: str):
    return TINY[family].create().eval()


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# capture


@pytest.mark.parametrize("family", list(TINY))
def test_attention_maps_shapes_and_rows(family):
    model = tiny(family)
    x = torch.randn(2, 3, 32, 32)
    maps = attention_maps(model, x)
    assert [m.kind for m in maps] == list(TINY[family].attention)
    gh, gw = model.patch_embed.grid_size
    for m in maps:
        B, H, Q, K = m.attn.shape
        assert (B, m.grid_size) == (2, (gh, gw)) and K == m.num_prefix + gh * gw
        assert Q == (1 if m.kind in ("class_attn", "attn_pool") else K)
        if m.kind != "talking_heads":  # probabilities: every row sums to 1
            torch.testing.assert_close(m.attn.sum(-1), torch.ones(B, H, Q), atol=1e-5, rtol=0)
    names = [m.name for m in maps]
    if family == "cait":
        assert names == ["blocks.0", "blocks.1", "blocks_token_only.0"]
        assert [m.prefix_tokens for m in maps] == [(), (), ("cls",)]
    if family == "convit":
        assert [m.prefix_tokens for m in maps] == [(), (), ("cls",)]
    if family == "deit":
        assert maps[0].prefix_tokens == ("cls", "dist")
    if family == "vit_avg":
        assert maps[0].prefix_tokens == ()


def test_talking_heads_rows_follow_proj_w():
    """Talking heads mix the heads after the softmax with proj_w (linear), so row h sums to
    sum_g proj_w.weight[h, g] + N * proj_w.bias[h], not to 1; capture reports the map as it is."""
    model = tiny("cait")
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.proj_w.weight.normal_(0.3, 0.2)
            blk.attn.proj_w.bias.normal_(0, 0.01)
    maps = attention_maps(model, torch.randn(2, 3, 32, 32))
    for m, blk in zip(maps, model.blocks):
        assert m.kind == "talking_heads"
        w, b = blk.attn.proj_w.weight, blk.attn.proj_w.bias
        N = m.attn.shape[-1]
        expected = (w.sum(dim=1) + N * b).view(1, -1, 1).expand(2, -1, N)
        torch.testing.assert_close(m.attn.sum(-1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["vit", "cait", "convit"])
def test_capture_restores_model(family):
    model = tiny(family)
    x = torch.randn(2, 3, 32, 32)
    fused = {m: m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")}
    assert fused and all(fused.values())
    with torch.no_grad():
        before = model(x)
    model.train()
    maps = attention_maps(model, x)
    grad_rollout(model, x, 1)
    with pytest.raises(RuntimeError, match="boom"), capture_attention(model):
        raise RuntimeError("boom")
    assert maps and _hooks(model) == 0
    assert all(m.training for m in model.modules())
    assert {m: m.fused_attn for m in fused} == fused
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
    assert not any(p.grad is not None for p in model.parameters())


def test_resnet_has_no_attention():
    with pytest.raises(ValueError, match="has no attention"):
        attention_maps(vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8)), torch.randn(1, 3, 32, 32))


# ---------------------------------------------------------------------------------------------
# rollout


def _rows(a):
    a = torch.as_tensor(a, dtype=torch.float64)
    return a / a.sum(-1, keepdim=True)


def _step(fused):  # hand rollout of one layer: add the residual identity, renormalise
    a = fused + torch.eye(fused.shape[-1], dtype=fused.dtype)
    return a / a.sum(-1, keepdim=True)


def test_rollout_matches_hand_computation():
    g = torch.Generator().manual_seed(1)
    a1 = _rows(torch.rand(1, 2, 5, 5, generator=g, dtype=torch.float64))  # cls + 2x2 patches, 2 heads
    a2 = _rows(torch.rand(1, 2, 5, 5, generator=g, dtype=torch.float64))
    maps = [AttentionMap(f"blocks.{i}", "mhsa", a.float(), ("cls",), (2, 2)) for i, a in enumerate((a1, a2))]
    R = _step(a2.mean(1)[0]) @ _step(a1.mean(1)[0])
    expected = R[0, 1:] / R[0, 1:].max()
    torch.testing.assert_close(rollout(maps)[0].double().flatten(), expected, atol=1e-6, rtol=0)
    R = _step(a2.amax(1)[0]) @ _step(a1.amax(1)[0])
    torch.testing.assert_close(rollout(maps, head_fusion="max")[0].double().flatten(), R[0, 1:] / R[0, 1:].max(),
                               atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="head_fusion"):
        rollout(maps, head_fusion="median")


def test_rollout_discard_keeps_class_to_class():
    # the class token's attention to itself (0.05) is its row's lowest entry, yet it is kept
    a = torch.tensor([[0.05, 0.50, 0.10, 0.20, 0.15],
                      [0.20, 0.20, 0.20, 0.20, 0.20],
                      [0.10, 0.10, 0.60, 0.10, 0.10],
                      [0.30, 0.30, 0.10, 0.20, 0.10],
                      [0.10, 0.20, 0.30, 0.25, 0.15]], dtype=torch.float64)
    maps = [AttentionMap("blocks.0", "mhsa", a[None, None].float(), ("cls",), (2, 2))]
    kept = a.clone()
    kept[0] = torch.tensor([0.05, 0.50, 0.0, 0.20, 0.0])  # 2 of 5 dropped: 0.10 and 0.15, never the 0.05
    R = _step(kept)
    out = rollout(maps, discard_ratio=0.4)[0].double().flatten()
    torch.testing.assert_close(out, R[0, 1:] / R[0, 1:].max(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="discard_ratio"):
        rollout(maps, discard_ratio=1.0)


def test_rollout_tokens_convit_and_cait_by_hand():
    g = torch.Generator().manual_seed(2)
    patch = _rows(torch.rand(1, 1, 4, 4, generator=g, dtype=torch.float64))  # no class token yet
    full = _rows(torch.rand(1, 1, 5, 5, generator=g, dtype=torch.float64))
    # ConViT: the early block gets an identity row and column for the class token
    maps = [AttentionMap("blocks.0", "gpsa", patch.float(), (), (2, 2)),
            AttentionMap("blocks.1", "mhsa", full.float(), ("cls",), (2, 2))]
    padded = torch.eye(5, dtype=torch.float64)
    padded[1:, 1:] = _step(patch[0, 0])
    R = _step(full[0, 0]) @ padded
    torch.testing.assert_close(rollout(maps)[0].double().flatten(), R[0, 1:] / R[0, 1:].max(), atol=1e-6, rtol=0)
    # CaiT: the class-attention row composed with the rollout of the patch-only blocks
    cls_row = _rows(torch.rand(1, 1, 1, 5, generator=g, dtype=torch.float64))
    maps = [AttentionMap("blocks.0", "talking_heads", patch.float(), (), (2, 2)),
            AttentionMap("blocks_token_only.0", "class_attn", cls_row.float(), ("cls",), (2, 2))]
    a0 = (cls_row[0, 0, 0] + torch.eye(5, dtype=torch.float64)[0]) / 2  # the class token's row with its residual
    expected = a0[1:] @ _step(patch[0, 0])
    torch.testing.assert_close(rollout(maps)[0].double().flatten(), expected / expected.max(), atol=1e-6, rtol=0)
    # the distillation token's row, and the mean over patch queries without a class token
    dist = _rows(torch.rand(1, 1, 6, 6, generator=g, dtype=torch.float64))
    maps = [AttentionMap("blocks.0", "mhsa", dist.float(), ("cls", "dist"), (2, 2))]
    R = _step(dist[0, 0])
    torch.testing.assert_close(rollout(maps, token="dist")[0].double().flatten(), R[1, 2:] / R[1, 2:].max(),
                               atol=1e-6, rtol=0)
    maps = [AttentionMap("blocks.0", "mhsa", patch.float(), (), (2, 2))]
    mean = _step(patch[0, 0]).mean(0)
    torch.testing.assert_close(rollout(maps)[0].double().flatten(), mean / mean.max(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="distilled"):
        rollout(maps, token="dist")


@pytest.mark.parametrize("family", list(TINY))
def test_rollout_and_grad_rollout_on_models(family):
    model = tiny(family)
    x = torch.randn(2, 3, 32, 32)
    gh, gw = model.patch_embed.grid_size
    for r in (rollout(model, x, discard_ratio=0.5), grad_rollout(model, x, [1, 2], discard_ratio=0.5)):
        assert r.shape == (2, gh, gw) and torch.isfinite(r).all()
        torch.testing.assert_close(r.amax(dim=(1, 2)), torch.ones(2))
    if family == "deit":
        assert rollout(model, x, token="dist").shape == (2, gh, gw)
    assert _hooks(model) == 0
    with pytest.raises(ValueError, match="target_class"):
        grad_rollout(model, x, 99)


# ---------------------------------------------------------------------------------------------
# distances


def test_patch_distances_by_hand():
    d = patch_distances((2, 2), (4, 4))
    s = 4 * math.sqrt(2)
    torch.testing.assert_close(d, torch.tensor([[0, 4, 4, s], [4, 0, s, 4], [4, s, 0, 4], [s, 4, 4, 0.0]]))


def test_attention_distance_uniform_and_identity():
    grid, patch, N = (3, 4), (2, 5), 12
    uniform = torch.full((2, 3, N + 1, N + 1), 1.0 / (N + 1))  # with a class token, dropped and renormalised
    expected = patch_distances(grid, patch).mean()
    torch.testing.assert_close(attention_distance(uniform, grid, patch, num_prefix=1), expected.expand(3))
    identity = torch.eye(N).expand(2, 3, N, N)
    torch.testing.assert_close(attention_distance(identity, grid, patch), torch.zeros(3))
    neighbour = torch.zeros(1, 1, N, N)  # each patch attends to the one on its right (or left at the edge)
    for i in range(N):
        neighbour[0, 0, i, i + 1 if (i % 4) < 3 else i - 1] = 1
    torch.testing.assert_close(attention_distance(neighbour, grid, patch), torch.tensor([5.0]))
    with pytest.raises(ValueError, match="prefix"):
        attention_distance(uniform, grid, patch)


def test_convit_local_where_random_vit_is_global():
    x = torch.randn(8, 3, 32, 32)
    convit = vitlab.create_model("convit_tiny_patch4_32", embed_dim=8, depth=3, local_up_to_layer=2,
                                 locality_strength=5.0)
    vit = vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=3, num_heads=4)
    d_convit, d_vit = mean_attention_distance(convit, x, batch_size=4), mean_attention_distance(vit, x)
    assert d_convit.shape == d_vit.shape == (3, 4)
    uniform = float(patch_distances((8, 8), (4, 4)).mean())
    assert d_vit.min() > 0.95 * uniform  # random weights: near-uniform, long-range attention
    assert d_convit[:2].max() < 0.5 * d_vit.min()  # the GPSA layers are local
    torch.testing.assert_close(convit_gates(convit), torch.full((2, 4), torch.sigmoid(torch.tensor(1.0)).item()))
    pos = positional_attention_distance(convit)
    assert pos.shape == (2, 4) and pos.max() < 4.0  # about one 4-pixel patch away
    with pytest.raises(ValueError, match="ConViT"):
        convit_gates(vit)


# ---------------------------------------------------------------------------------------------
# embeddings


def test_sincos_position_similarity_falls_with_distance():
    sim = position_similarity(vitlab.create_model("vit_tiny_sincos_patch4_32"))
    assert sim.shape == (8, 8, 8, 8)
    flat = sim.reshape(64, 64)
    torch.testing.assert_close(flat.diagonal(), torch.ones(64))
    assert (flat.argmax(dim=1) == torch.arange(64)).all()  # every patch is most similar to itself
    for r, c in [(3, 4), (0, 0), (7, 2)]:
        along_row = sim[r, c, r, c:]  # moving away to the right, then down
        along_col = sim[r, c, r:, c]
        assert (along_row.diff() < 0).all() and (along_col.diff() < 0).all()


def test_position_similarity_errors():
    with pytest.raises(ValueError, match="no position embedding"):
        position_similarity(vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2,
                                                pos_embed="none"))
    with pytest.raises(ValueError, match="no position embedding"):
        position_similarity(vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8)))
    learned = position_similarity(tiny("convit"))
    assert learned.shape == (8, 8, 8, 8)


def test_embedding_filters():
    model = tiny("vit")
    comps = embedding_filters(model, k=5)
    assert comps.shape == (5, 3, 4, 4)
    flat = comps.reshape(5, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(5), atol=1e-5, rtol=0)  # orthonormal components
    # the first component is the top direction of the centred filters
    w = model.patch_embed.proj.weight.detach().reshape(32, -1)
    w = w - w.mean(0)
    top = torch.linalg.eigh(w.T @ w).eigenvectors[:, -1]
    assert abs(float(top @ flat[0])) == pytest.approx(1.0, abs=1e-4)
    assert embedding_filters(model, k=100).shape[0] == 32  # at most the rank
    with pytest.raises(ValueError, match="hybrid"):
        embedding_filters(tiny("hybrid"))
    with pytest.raises(ValueError, match="CNN"):
        embedding_filters(vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8)))


# ---------------------------------------------------------------------------------------------
# figures


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def _has_colorbar(fig) -> bool:
    return any(hasattr(ax, "_colorbar") for ax in fig.axes)


def test_plots_have_titles_labels_and_colorbars():
    x = torch.randn(2, 3, 32, 32)
    images = plots.display_images(x, (0.5,) * 3, (0.5,) * 3)
    assert images.shape == (2, 32, 32, 3) and 0 <= images.min() and images.max() <= 1
    convit, cait = tiny("convit"), tiny("cait")
    maps = attention_maps(cait, x)
    figures = {
        "heads": (plots.plot_attention_heads(maps, 0, images[0]), ["Attention", "head 0", "attention head"], True),
        "rollout": (plots.plot_rollout(images, {"rollout": rollout(maps)}, ["a", "b"]), ["Attention rollout"], True),
        "distance": (plots.plot_attention_distance(mean_attention_distance(convit, x), ["gpsa", "gpsa", "mhsa"],
                                                   (8, 8), (4, 4)),
                     ["Mean attention distance", "network depth (layer)", "mean attention distance (pixels)"], False),
        "similarity": (plots.plot_position_similarity(position_similarity(convit)),
                       ["Position embedding similarity", "input patch column", "input patch row"], True),
        "filters": (plots.plot_embedding_filters(embedding_filters(cait, k=6)), ["Principal components", "PC 1"],
                    False),
        "gates": (plots.plot_convit_gates(convit_gates(convit), positional_attention_distance(convit)),
                  ["ConViT gates", "head", "GPSA layer"], True),
        "class_attn": (plots.plot_class_attention(maps, images, [0, 1]), ["CaiT class attention", "head 0"], True),
        "patch_grid": (plots.plot_patch_grid(images, (4, 4), ["a", "b"], ("cls",)),
                       ["patch grid", "8x8 patches of 4x4 pixels", "x (pixels)", "y (pixels)", "[cls]", "63"], False),
    }
    for name, (fig, expected, colorbar) in figures.items():
        texts = " | ".join(_texts(fig))
        for e in expected:
            assert e in texts, f"{name}: {e!r} not in {texts}"
        assert _has_colorbar(fig) == colorbar or colorbar is False, name
    grey = plots.plot_embedding_filters(embedding_filters(vitlab.create_model("vit_micro_patch2_8"), k=3))
    assert _has_colorbar(grey)  # one channel: grey values encode weights


def test_analysis_draws_without_pyplot_or_a_backend_switch():
    """Figures are matplotlib Figures on the Agg canvas: nothing in analysis/ touches pyplot's global state."""
    folder = Path(plots.__file__).parent
    for path in folder.glob("*.py"):
        found = re.search(r"^\s*(import matplotlib\.pyplot|from matplotlib import pyplot|matplotlib\.use\()",
                          path.read_text(), re.MULTILINE)
        assert found is None, f"{path.name}: {found and found.group(0)}"


# ---------------------------------------------------------------------------------------------
# vitlab inspect


def _parser():
    p = argparse.ArgumentParser(prog="vitlab")
    command.register(p.add_subparsers(dest="command"))
    return p


def _inspect(*argv) -> int:
    args = _parser().parse_args(["inspect", *map(str, argv)])
    return args.func(args)


def _images(folder: Path, n: int = 2) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        a = (rng.random((40, 36, 3)) * 255).astype(np.uint8)
        p = folder / f"img{i}.png"
        Image.fromarray(a).convert("RGBA" if i % 2 else "RGB").save(p)
        paths.append(p)
    return paths


def _check_report(out: Path, expected: set[str]) -> str:
    """report.html is self-contained: every figure is an embedded PNG (also written next to it), nothing external."""
    html = (out / "report.html").read_text()
    imgs = re.findall(r'<img src="data:image/png;base64,([^"]+)" data-file="([^"]+)"', html)
    assert imgs, "the report shows no image"
    for data, name in imgs:
        assert base64.b64decode(data) == (out / name).read_bytes(), name
    assert expected <= {name for _, name in imgs}, expected - {name for _, name in imgs}
    assert not re.search(r'(src|href)="(?!data:)', html), "the report links to another file"
    assert "http://" not in html and "https://" not in html
    faith = json.loads((out / "faithfulness.json").read_text())
    assert {"raw_attention", "rollout", "grad_rollout", "relevance", "saliency", "random", "edge"} <= set(
        faith["methods"])
    return html


def test_inspect_a_training_run_folder(tmp_path, cache_dir):
    """A CIFAR-shaped run written by `vitlab train` (on a small colour image folder) inspects end to end."""
    import numpy as np
    from PIL import Image

    from vitlab.cli import main as cli_main

    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("test", 8)):
        for name, channel in (("red", 0), ("blue", 2)):
            folder = tmp_path / "shapes" / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
                y, x = rng.integers(0, 20, 2)
                img[y:y + 12, x:x + 12, channel] = 230
                Image.fromarray(img).save(folder / f"{i}.png")
    run = tmp_path / "run"
    assert cli_main(["train", "--model", "vit_tiny_patch4_32", "--model-arg", "embed_dim=32", "--model-arg",
                     "depth=2", "--model-arg", "num_heads=2", "--data", str(tmp_path / "shapes"), "--epochs", "2",
                     "--batch-size", "16", "--precision", "fp32", "--out", str(run)]) == 0
    out = tmp_path / "report"
    assert _inspect(run, "--data", tmp_path / "shapes", "--num-images", 3, "--out", out) == 0
    html = _check_report(out, {"attention_heads_0.png", "rollout.png", "attention_distance.png",
                               "position_similarity.png", "embedding_filters.png", "faithfulness.png",
                               "randomisation.png", "head_importance.png"})
    assert "blue" in html and "red" in html  # class names from the run


def test_inspect_saved_cifar_model(tmp_path, capsys):
    model = vitlab.create_model("vit_tiny_patch4_32", embed_dim=32, depth=2, num_heads=2)
    folder = vitlab.save(model, tmp_path / "run")
    out = tmp_path / "report"
    assert _inspect(folder, "--images", *_images(tmp_path), "--out", out, "--discard-ratio", "0.5") == 0
    html = _check_report(out, {"patch_grid.png", "attention_heads_0.png", "attention_heads_1.png", "rollout.png",
                               "attention_distance.png", "position_similarity.png", "embedding_filters.png"})
    assert "The image cut into its patch grid" in html and "8x8 grid of 4x4-pixel patches" in html
    assert "Ten ways to ask" in html and "gradient saliency" in html and "AttnLRP" in html
    assert "vit_tiny_patch4_32" in html and "top-5 predictions" in html and html.count("&mdash;") == 2 * 5
    assert "skipped" in html and "not a ConViT" in html and "not a CaiT" in html
    assert "report.html" in capsys.readouterr().out


@pytest.mark.parametrize("fixture, extra", [("timm_convit", {"convit_gates.png", "convit_positional.png"}),
                                            ("timm_cait", {"cait_class_attention.png"})])
def test_inspect_parity_models(tmp_path, fixture, extra):
    folder = PARITY / fixture
    if not folder.is_dir():
        pytest.skip(f"{folder} is not available")
    out = tmp_path / "report"
    assert _inspect(folder, "--images", *_images(tmp_path, 1), "--out", out) == 0
    html = _check_report(out, {"attention_heads_0.png", "rollout.png", "attention_distance.png",
                               "position_similarity.png", "embedding_filters.png"} | extra)
    assert ("ConViT" if fixture == "timm_convit" else "CaiT") in html


def test_inspect_errors(tmp_path):
    resnet = vitlab.save(vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8)), tmp_path / "resnet")
    with pytest.raises(ValueError, match="has no attention"):
        _inspect(resnet, "--images", *_images(tmp_path, 1))
    vit = vitlab.save(tiny("vit"), tmp_path / "vit")
    with pytest.raises(ValueError, match="--images FILE... or --data"):
        _inspect(vit)
    with pytest.raises(ValueError, match="missing.png does not exist"):
        _inspect(vit, "--images", tmp_path / "missing.png")
    (tmp_path / "not_an_image.png").write_text("hello")
    with pytest.raises(ValueError, match="not an image"):
        _inspect(vit, "--images", tmp_path / "not_an_image.png")
    with pytest.raises(SystemExit):
        _inspect(vit, "--head-fusion", "median")


def test_python_inspect_of_a_module_writes_the_report_and_returns_what_it_wrote(tmp_path, cache_dir):
    """vitlab.inspect, the command's Python face: a module in memory (an 8x8 one: the digits by default)."""
    model = vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2)
    found = vitlab.inspect(model, num_images=2, distance_images=8, importance_images=4, curve_steps=4,
                           out=tmp_path / "report")
    assert isinstance(found, vitlab.InspectResult) and found.report == tmp_path / "report" / "report.html"
    _check_report(found.out, {"patch_grid.png", "attention_heads_0.png", "rollout.png", "faithfulness.png",
                              "randomisation.png", "head_importance.png", "attention_distance.png"})
    assert {"analysis.json", "faithfulness.json", "rollout.png"} <= set(found.files)
    assert found.faithfulness == json.loads((found.out / "faithfulness.json").read_text())
    assert found.faithfulness["protocol"]["images"] == 2 and "relevance" in found.faithfulness["methods"]
    assert len(found.summary["predictions"]) == 2 and "head_importance" in found.summary
    assert next(model.parameters()).device.type == "cpu"  # analysed where it is


@pytest.mark.parametrize("options, words", [
    ({"num_images": 0}, "num_images 0 is not valid; accepted: an integer >= 1"),
    ({"importance_images": 0}, "importance_images 0 is not valid; accepted: an integer >= 1"),
    ({"faithfulness_images": -1}, "faithfulness_images -1 is not valid; accepted: an integer >= 0"),
    ({"curve_steps": 1.5}, "curve_steps 1.5 is not valid; accepted: an integer >= 1"),
    ({"discard_ratio": 1.0}, "discard_ratio 1.0 is not valid; accepted: a number in [0, 1)"),
    ({"head_fusion": "median"}, "head_fusion 'median' is not valid; accepted: mean, max, min"),
    ({"precision": "half"}, "precision 'half' is not valid; accepted: auto"),
    ({"device": "tpu"}, "device='tpu' is not valid; accepted: auto, cpu, cuda"),
    ({"data": "digits", "images": ["a.png"]}, "give data or images, not both"),
    ({"faithfulness_images": 4}, "faithfulness_images needs data=SET"),
    ({"images": "a.png"}, "images='a.png' is not valid; accepted: a list of one or more image files"),
])
def test_python_inspect_refuses_a_bad_option_in_one_line(tmp_path, cache_dir, options, words):
    model = vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2)
    with pytest.raises(VitlabError) as refused:
        vitlab.inspect(model, out=tmp_path / "r", **options)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_patch_grid_section_draws_the_models_grid_or_skips(tmp_path):
    from vitlab.analysis.report import Inspection
    from vitlab.analysis.sections import SECTIONS, patch_grid

    assert SECTIONS[0] is patch_grid
    resnet = vitlab.create_model("resnet10_32", widths=(8, 8, 8, 8))
    r = Inspection(resnet, torch.randn(2, 3, 32, 32), tmp_path / "cnn")
    patch_grid(r)
    assert r.sections == [] and "skipped" in r.notes[0] and not any((tmp_path / "cnn").iterdir())
    hybrid = tiny("hybrid")
    r = Inspection(hybrid, torch.randn(3, 3, 32, 32), tmp_path / "hybrid", image_names=["a", "b", "c"])
    patch_grid(r)
    (section,) = r.sections
    (ph, pw), (gh, gw) = hybrid.patch_embed.patch_size, hybrid.patch_embed.grid_size
    assert section.file == "patch_grid.png" and (tmp_path / "hybrid" / "patch_grid.png").is_file()
    assert f"{gh}x{gw} grid of {ph}x{pw}-pixel patches" in section.caption and "ResNet" in section.caption
    assert "[cls]" in section.caption and not r.notes


def test_inspect_digits_by_default(tmp_path, cache_dir):
    folder = vitlab.save(vitlab.create_model("vit_micro_patch2_8", depth=1), tmp_path / "micro")
    out = tmp_path / "report"
    assert _inspect(folder, "--num-images", 2, "--distance-images", 40, "--batch-size", 16, "--out", out) == 0
    html = _check_report(out, {"patch_grid.png", "attention_heads_0.png", "rollout.png", "embedding_filters.png"})
    assert "digits test #1" in html and "40 image(s)" in html
