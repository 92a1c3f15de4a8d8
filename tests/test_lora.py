"""LoRA fine-tuning through peft and gradient checkpointing: what trains, what the run folder keeps, resume."""
import json
import shutil

import pytest
import torch
from conftest import FAMILY
from safetensors.torch import load_file
from test_finetune import QUICK, noise_folder, pretrained, stop_at

import vitlab
from vitlab.cli import main
from vitlab.runs.format import load_checkpoint
from vitlab.train import load_recipe, train

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return noise_folder(tmp_path_factory.mktemp("data") / "noise")


def lora_run(folder, tmp_path, lines, **values):
    init = pretrained("vit", tmp_path / "init")
    out = tmp_path / "run"
    train(load_recipe(None, data=str(folder), init=str(init), lora=4, lr=0.05, out=str(out), **{**QUICK, **values}),
          log=lines.append)
    return init, out


def test_lora_trains_the_adapters_and_head_and_saves_them_merged(folder, tmp_path, cache_dir):
    lines = []
    init, out = lora_run(folder, tmp_path, lines)
    before, after = vitlab.load(init), vitlab.load(out)
    said = next(line for line in lines if line.startswith("LoRA rank 4"))
    # trained: per block r x (in + out) for qkv, proj, fc1, fc2, then the new 3-class head
    d, depth = before.embed_dim, len(before.blocks)
    hidden = before.blocks[0].mlp.fc1.out_features
    adapters = depth * 4 * (d + 3 * d + d + d + d + hidden + hidden + d)
    head = d * 3 + 3
    total = sum(p.numel() for p in after.parameters())
    assert said.endswith(f"{adapters + head:,} of {total:,} parameters trainable"), said
    assert adapters + head < total / 5
    # the folder is an ordinary model of timm's names; the adapter layers changed only through the merge
    assert set(dict(after.named_parameters())) == set(dict(before.named_parameters()))
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and len(config["target_modules"]) == 4 * len(before.blocks)
    assert {t.rsplit(".", 1)[-1] for t in config["target_modules"]} == {"fc1", "fc2", "proj", "qkv"}
    scale = config["lora_alpha"] / config["r"]
    old = dict(before.named_parameters())
    adapted = 0
    for name, p in after.named_parameters():
        layer = name.rsplit(".", 1)[0]
        a = adapter.get(f"base_model.model.{layer}.lora_A.weight")
        if a is not None and name.endswith(".weight"):
            b = adapter[f"base_model.model.{layer}.lora_B.weight"]
            assert torch.allclose(p, old[name] + scale * b @ a, atol=1e-6), name
            assert not torch.equal(p, old[name]), name
            adapted += 1
        elif not name.startswith("head."):
            assert torch.equal(p, old[name]), name
    assert adapted == 4 * depth


def test_lora_run_exports_to_timm_with_its_own_outputs(folder, tmp_path, cache_dir):
    _, out = lora_run(folder, tmp_path, [])
    assert main(["export", str(out), "--to", "timm", "--out", str(tmp_path / "timm")]) == 0
    keys = load_file(tmp_path / "timm" / "model.safetensors").keys()
    assert "blocks.0.attn.qkv.weight" in keys and not any("lora" in k or "base_layer" in k for k in keys)
    ours, theirs = vitlab.load(out).eval(), vitlab.load(tmp_path / "timm").eval()
    x = torch.randn(2, 3, *ours.pretrained_cfg["input_size"][1:])
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), atol=1e-5)


def test_lora_resume_after_a_kill_is_the_uninterrupted_run(folder, tmp_path, cache_dir):
    init = pretrained("vit", tmp_path / "init")
    recipe = dict(data=str(folder), init=str(init), lora=2, lr=0.05, **{**QUICK, "epochs": 2})
    train(load_recipe(None, out=str(tmp_path / "whole"), **recipe))
    with pytest.raises(KeyboardInterrupt):
        train(load_recipe(None, out=str(tmp_path / "cut"), **recipe), log=stop_at("epoch 2:"))
    assert any("lora_A" in k for k in load_checkpoint(tmp_path / "cut")["model"])
    train(load_recipe(None, out=str(tmp_path / "cut"), **recipe), resume=True)
    whole, cut = vitlab.load(tmp_path / "whole"), vitlab.load(tmp_path / "cut")
    for (name, p), q in zip(whole.state_dict().items(), cut.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    shutil.rmtree(tmp_path / "whole")


def test_lora_refuses_unknown_targets_and_other_freezing_in_one_line(folder, tmp_path, cache_dir):
    init = pretrained("vit", tmp_path / "init")
    with pytest.raises(ValueError, match=r"lora_targets qkvv: VisionTransformer has no Linear layer of that name; "
                                         r"accepted: fc1, fc2, proj, qkv"):
        train(load_recipe(None, data=str(folder), init=str(init), lora=2, lora_targets="qkvv",
                          out=str(tmp_path / "r"), **QUICK))
    with pytest.raises(ValueError, match="lora=2 is not valid with freeze_backbone"):
        load_recipe(None, init=str(init), lora=2, freeze_backbone=True)
    with pytest.raises(ValueError, match="lora_alpha=8 needs LoRA"):
        load_recipe(None, lora_alpha=8)


def test_lora_without_peft_names_the_extra(folder, tmp_path, cache_dir, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    init = pretrained("vit", tmp_path / "init")
    with pytest.raises(ValueError, match=r"^--lora needs Hugging Face peft: pip install 'vitlab\[lora\]'$"):
        train(load_recipe(None, data=str(folder), init=str(init), lora=2, out=str(tmp_path / "r"), **QUICK))


@pytest.mark.parametrize("family", ["vit", "cait", "beit", "eva02", "dinov3"])
def test_grad_checkpointing_keeps_outputs_and_gradients(family):
    torch.manual_seed(0)
    model = FAMILY[family].create(num_classes=3).train()
    x = torch.randn(2, 3, *model.pretrained_cfg["input_size"][1:])

    def run():
        torch.manual_seed(1)  # the same drop-path draws
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_out, plain_grads = run()
    model.set_grad_checkpointing(True)
    ckpt_out, ckpt_grads = run()
    assert torch.allclose(plain_out, ckpt_out, atol=1e-6)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, g in plain_grads.items():
        assert torch.allclose(g, ckpt_grads[name], atol=1e-5), name
    model.set_grad_checkpointing(False)
    assert all("forward" not in blk.__dict__ for blk in model.blocks)


def test_grad_checkpointing_recomputes_the_blocks():
    torch.manual_seed(0)
    model = FAMILY["vit"].create(num_classes=3).train()
    calls = []
    model.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    x = torch.randn(1, 3, *model.pretrained_cfg["input_size"][1:])
    model(x).sum().backward()
    assert len(calls) == 1
    model.set_grad_checkpointing(True)
    calls.clear()
    model(x).sum().backward()
    assert len(calls) == 2  # once forward, once again in the backward pass
