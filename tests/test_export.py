"""vitlab export: ONNX checked with onnxruntime, timm and transformers folders that load back to the same logits."""
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ATTENTION_FAMILIES, FAMILIES, FAMILY, PARITY
from safetensors.torch import load_file

import vitlab
from vitlab.cli import main
from vitlab.export import export


def noisy(name, std=0.05, **args):
    """A model whose every parameter matters (init plus noise), in eval mode; ``name`` registered or a family."""
    model = FAMILY[name].create(**args) if name in FAMILY else vitlab.create_model(name, **args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * std)
    return model.eval()


def logits_close(a, b, x, atol=1e-5):
    with torch.no_grad():
        return torch.allclose(a(x), b(x), atol=atol)


def batch(model, n=2):
    return torch.randn(n, *model.pretrained_cfg["input_size"])


@pytest.mark.parametrize("family", FAMILY)
def test_onnx_matches_pytorch_at_two_batch_sizes(tmp_path, family):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'vitlab[onnx]')")
    from vitlab.interop.onnx import max_difference

    model = noisy(family)
    path = export(model, "onnx", tmp_path / "onnx", check=False)
    assert path.name == "model.onnx"
    assert max_difference(model, path, batches=(1, 4)) < 1e-4
    info = json.loads((tmp_path / "onnx" / "preprocess.json").read_text())
    assert info["input_size"] == list(model.pretrained_cfg["input_size"])
    assert info["dynamic_img_size"] is bool(getattr(model, "dynamic_img_size", False))  # DINOv3's names: any size


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_onnx_dynamic_image_size(tmp_path, family):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'vitlab[onnx]')")
    from vitlab.interop.onnx import max_difference

    model = noisy(family, dynamic_img_size=True)
    path = export(model, "onnx", tmp_path / "onnx")  # check=True: the export itself compares at the model's size
    # the position embedding is resampled inside the graph for other sizes (bicubic with antialias)
    assert max_difference(model, path, batches=(1, 3), sizes=[(32, 32), (48, 40), (16, 24)]) < 1e-4


@pytest.mark.parametrize("family", [f.id for f in FAMILIES if f.timm])
def test_timm_folder_round_trip(tmp_path, family):
    model = noisy(family)
    folder = export(model, "timm", tmp_path / "timm")
    cfg = json.loads((folder / "config.json").read_text())
    assert {"architecture", "num_classes", "model_args", "pretrained_cfg"} <= cfg.keys()
    assert {"input_size", "mean", "std", "interpolation", "crop_pct", "num_classes", "first_conv",
            "classifier"} <= cfg["pretrained_cfg"].keys()
    assert "distilled" not in cfg["model_args"]
    assert ("norm_eps" in cfg["model_args"]) is family.startswith(("qwen3", "gemma4", "deepseek"))  # timm's take it
    prefixes = {"deit": "deit_", "convit": "convit_", "cait": "cait_", "deit3": "deit3_", "beit": "beit_",
                "beit_shared": "beit_", "mixer": "mixer_", "eva02": "eva02_", "naflex_siglip": "naflexvit_",
                "eva_post_norm": "eva02_", "aimv2": "aimv2_",
                "qwen3": "qwen3_", "qwen3_merge": "qwen3_", "gemma4": "gemma4_", "gemma4_soft": "gemma4_",
                "deepseek": "deepseek_", "deepseek_align": "deepseek_"}
    assert cfg["architecture"].startswith(prefixes.get(family, "vit_"))
    keys = load_file(folder / "model.safetensors").keys()
    if family == "cait":  # timm's LayerScale names in CaiT
        assert "blocks.0.gamma_1" in keys and "blocks_token_only.0.gamma_2" in keys
    if family.startswith("beit"):  # and in BEiT, with its query and value biases
        assert {"blocks.0.gamma_1", "blocks.1.gamma_2", "blocks.0.attn.q_bias", "blocks.0.attn.v_bias"} <= keys
    if family in ("cait", "beit", "beit_shared", "eva02", "rope_mixed"):  # and in EVA's blocks
        assert not any(".ls1." in k for k in keys)
    back = vitlab.load(folder)
    assert logits_close(model, back, batch(model))
    assert back.pretrained_cfg["label_names"] is None or back.pretrained_cfg["label_names"] == \
        model.pretrained_cfg["label_names"]


def test_timm_resnet_and_label_names(tmp_path):
    model = noisy("resnet18", num_classes=3, img_size=64)
    model.pretrained_cfg["label_names"] = ["cat", "dog", "owl"]
    folder = export(model, "timm", tmp_path / "r")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architecture"] == "resnet18" and cfg["label_names"] == ["cat", "dog", "owl"]
    assert cfg["pretrained_cfg"]["first_conv"] == "conv1" and cfg["pretrained_cfg"]["classifier"] == "fc"
    back = vitlab.load(folder)
    assert back.pretrained_cfg["label_names"] == ["cat", "dog", "owl"]
    assert logits_close(model, back, torch.randn(2, 3, 64, 64))


BACKBONES = Path(__file__).parent / "fixtures" / "parity"


@pytest.mark.parametrize("fixture", ["timm_vit_token", "timm_vit_avg_noclass", "timm_vit_layerscale",
                                     "timm_deit_distilled", "timm_cait", "timm_convit"]
                         + sorted(p.name for p in BACKBONES.glob("timm_*")))
def test_timm_fixture_exports_timm_keys(tmp_path, fixture):
    """A timm checkpoint loaded into vitlab and exported again has timm's own tensor names and values."""
    src = (BACKBONES if (BACKBONES / fixture).is_dir() else PARITY) / fixture
    folder = export(vitlab.load(src), "timm", tmp_path / "t")
    ours, theirs = load_file(folder / "model.safetensors"), load_file(src / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    cfg = json.loads((folder / "config.json").read_text())
    ref = json.loads((src / "config.json").read_text())
    assert cfg["architecture"] == ref["architecture"]
    for key, value in ref["model_args"].items():
        assert cfg["model_args"][key] == value, key


@pytest.mark.parametrize("family", [f.id for f in FAMILIES if f.hf])
def test_hf_folder_round_trip(tmp_path, family):
    model = noisy(family)
    model.pretrained_cfg["label_names"] = [f"class {i}" for i in range(10)]
    folder = export(model, "hf", tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [{"deit": "DeiTForImageClassificationWithTeacher"}.get(
        family, "BeitForImageClassification" if family.startswith("beit") else "ViTForImageClassification")]
    assert cfg["id2label"]["3"] == "class 3" and cfg["label2id"]["class 3"] == 3
    assert (folder / "preprocessor_config.json").is_file()
    back = vitlab.load(folder)
    assert logits_close(model, back, batch(model))
    assert back.pretrained_cfg["label_names"] == model.pretrained_cfg["label_names"]
    assert back.pretrained_cfg["mean"] == pytest.approx(model.pretrained_cfg["mean"])


@pytest.mark.parametrize("fixture", ["hf_vit", "hf_deit_distilled"])
def test_hf_fixture_exports_hub_keys(tmp_path, fixture):
    folder = export(vitlab.load(PARITY / fixture), "hf", tmp_path / "h")
    ours, theirs = load_file(folder / "model.safetensors"), load_file(PARITY / fixture / "model.safetensors")
    theirs = {k: v for k, v in theirs.items() if ".pooler." not in k}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    cfg = json.loads((folder / "config.json").read_text())
    ref = json.loads((PARITY / fixture / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "hidden_act", "layer_norm_eps", "image_size", "patch_size", "qkv_bias",
                "id2label"):
        assert cfg[key] == ref[key], key


@pytest.mark.parametrize("family, to, missing", [
    ("hybrid", "hf", "a hybrid ViT"),
    ("hybrid", "timm", "timm has no hybrid ViT"),
    ("cait", "hf", "CaiT"),
    ("convit", "hf", "ConViT"),
    ("resnet", "hf", "a ResNet"),
    ("resnet", "timm", "stem='cifar'"),
])
def test_inexpressible_model_names_what_is_missing(tmp_path, family, to, missing):
    with pytest.raises(ValueError, match=missing) as err:
        export(FAMILY[family].create(), to, tmp_path / "x")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family, to", [(f.id, to) for f in FAMILIES for to, ok in (("timm", f.timm), ("hf", f.hf))
                                         if not ok])
def test_a_format_that_cannot_hold_a_family_says_so_in_one_line(tmp_path, family, to):
    model = FAMILY[family].create()
    with pytest.raises(ValueError, match="; export .*onnx$") as err:
        export(model, to, tmp_path / "x")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x").exists()


def test_interop_reads_the_facts_off_the_model(tmp_path, monkeypatch):
    """What timm and transformers lack is the model's own word; a registered timm name is kept on export."""
    model = FAMILY["hybrid"].create()
    monkeypatch.setattr(type(model), "no_timm", "timm lacks this one")
    monkeypatch.setattr(type(model), "no_hf", "this one")
    with pytest.raises(ValueError, match="^timm lacks this one; export this model with --to onnx$"):
        export(model, "timm", tmp_path / "t")
    with pytest.raises(ValueError, match="cannot express this one; export it with --to onnx$"):
        export(model, "hf", tmp_path / "h")
    cait = noisy("cait_s24_224", img_size=32, embed_dim=32, depth=1, num_heads=2, depth_token_only=1, num_classes=3)
    assert _architecture(export(cait, "timm", tmp_path / "c")) == "cait_s24_224"
    monkeypatch.setattr(type(cait), "timm_names", frozenset())
    assert _architecture(export(cait, "timm", tmp_path / "b")) == cait.timm_spec.base_arch == "cait_xxs24_224"


def _architecture(folder):
    return json.loads((folder / "config.json").read_text())["architecture"]


@pytest.mark.parametrize("args, missing", [
    (dict(global_pool="avg", class_token=False), "pooling other than the class token"),
    (dict(init_values=1e-5), "LayerScale"),
    (dict(reg_tokens=2), "register tokens"),
])
def test_hf_names_missing_vit_features(tmp_path, args, missing):
    with pytest.raises(ValueError, match=missing):
        export(vitlab.create_model("vit_nano_patch4_32", **args), "hf", tmp_path / "x")


def test_export_cli(tmp_path, capsys):
    model = noisy("vit_nano_patch4_32", depth=1)
    vitlab.save(model, tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), "--to", "timm", "--out", str(tmp_path / "t")]) == 0
    assert logits_close(model, vitlab.load(tmp_path / "t"), batch(model))
    assert main(["export", str(tmp_path / "m"), "--to", "hf", "--out", str(tmp_path / "h")]) == 0
    assert main(["export", str(tmp_path / "m"), "--to", "onnx", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.onnx").is_file()
    capsys.readouterr()
    vitlab.save(vitlab.create_model("vit_nano_r18_32", depth=1), tmp_path / "hybrid")
    assert main(["export", str(tmp_path / "hybrid"), "--to", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab export: error: ") and "hybrid ViT" in err and err.count("\n") == 1


def test_onnx_export_says_how_it_was_checked(tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'vitlab[onnx]')")
    vitlab.save(noisy("vit_nano_patch4_32", depth=1), tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), "--to", "onnx", "--out", str(tmp_path / "o")]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"{tmp_path / 'o' / 'model.onnx'} checked with onnxruntime: its logits differ from "
                              "PyTorch's by at most ") and said[0].endswith("(tolerance 0.0001)")
    assert float(said[0].split("at most ")[1].split()[0]) < 1e-4
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as where it is not installed: said, not skipped silently
    assert main(["export", str(tmp_path / "m"), "--to", "onnx", "--out", str(tmp_path / "o2")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{tmp_path / 'o2' / 'model.onnx'} not checked: onnxruntime is not installed (pip install 'vitlab[onnx]' to "
        "compare it with PyTorch)")
    assert main(["export", str(tmp_path / "m"), "--to", "onnx", "--no-check", "--out", str(tmp_path / "o3")]) == 0
    assert "checked" not in capsys.readouterr().out


def test_a_second_export_into_the_folder_of_the_first_replaces_its_own_files(tmp_path, capsys):
    vitlab.save(noisy("vit_nano_patch4_32", depth=1), tmp_path / "m")
    vitlab.save(noisy("vit_nano_patch4_32", depth=1), tmp_path / "m2")
    out = tmp_path / "o"
    written = []
    for model in ("m", "m2"):
        assert main(["export", str(tmp_path / model), "--to", "onnx", "--no-check", "--out", str(out)]) == 0
        written.append((out / "model.onnx").read_bytes())
    assert written[0] != written[1]  # the second model's graph in place of the first's
    assert sorted(p.name for p in out.iterdir()) == [".vitlab", "model.onnx", "preprocess.json"]
    (out / "notes.txt").write_text("mine")  # a file of the user's: the folder is not the export's alone any more
    capsys.readouterr()
    assert main(["export", str(tmp_path / "m"), "--to", "onnx", "--no-check", "--out", str(out)]) == 2
    assert "holds files that vitlab export did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("before", [False, True])
def test_an_onnx_export_onto_a_full_disk_names_the_file_and_leaves_nothing_half_written(before, tmp_path, capsys,
                                                                                         monkeypatch):
    import errno
    import os

    from vitlab.runs import folder
    from vitlab.runs.folder import LOCK
    vitlab.save(noisy("vit_nano_patch4_32", depth=1), tmp_path / "m")
    out = tmp_path / "o"
    argv = ["export", str(tmp_path / "m"), "--to", "onnx", "--no-check", "--out", str(out)]
    if before:
        assert main(argv) == 0
    kept = {p.name: p.read_bytes() for p in out.iterdir()} if before else None

    def full(model, args, f, **kwargs):  # the exporter's write stops part-way: no space left
        Path(f).write_bytes(b"\x08\x09half an ONNX file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_room(path, data):  # nor for any other new file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch.onnx, "export", full)
    monkeypatch.setattr(folder, "atomic_write_bytes", no_room)
    capsys.readouterr()
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"vitlab export: error: disk full: writing {out / 'model.onnx'} stopped after ")
    assert line.endswith("free some space and run again")
    if before:  # the earlier export whole, with no lock and no temporary file beside it
        assert "the previous model.onnx is kept" in line
        assert {p.name: p.read_bytes() for p in out.iterdir()} == kept and LOCK not in kept
    else:  # nothing at all: the folder the export made is gone
        assert "no half-written model.onnx is left" in line and not out.exists()
