"""Fine-tuning in training runs: layer-wise lr decay, head initialisation and block freezing, end to end."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import FAMILIES, FAMILY
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.models.groups import layer_ids
from vitlab.runs.format import load_checkpoint
from vitlab.train import load_recipe, train
from vitlab.train.build import epoch_plan
from vitlab.train.finetune import fit_head
from vitlab.train.schedule import describe_warmup, step_share, warmup_cosine

DECAY = 0.5
QUICK = dict(epochs=1, batch_size=8, precision="fp32", threads=1, warmup=0.0, auto_augment="none", mixup=0.0,
             cutmix=0.0, random_erasing=0.0)


def noise_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 32) -> Path:
    """root/c<i>/<n>.png: random RGB images."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return noise_folder(tmp_path_factory.mktemp("data") / "noise")


def pretrained(family_id: str, path: Path, num_classes: int = 5) -> Path:
    torch.manual_seed(1)
    vitlab.save(FAMILY[family_id].create(num_classes=num_classes), path)
    return path


@pytest.mark.parametrize("family", [f.id for f in FAMILIES])
def test_trained_runs_groups_follow_layer_decay(family, folder, tmp_path, cache_dir):
    init = pretrained(family, tmp_path / "init")
    out = tmp_path / "run"
    lines = []
    train(load_recipe(None, data=str(folder), init=str(init), layer_decay=DECAY, out=str(out), **QUICK),
          log=lines.append)
    model = vitlab.load(out)
    ids, depth = layer_ids(model)
    groups = load_checkpoint(out)["optimizer"]["param_groups"]
    last_lr = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["lr"]
    assert last_lr > 0
    # BEiT: the embeddings are layer 0, block i layer i + 1, the final norm and the heads depth + 1
    assert {g["layer"] for g in groups} == set(range(depth + 2))
    for g in groups:
        assert g["lr_scale"] == pytest.approx(DECAY ** (depth + 1 - g["layer"]))
        assert g["lr"] == pytest.approx(last_lr * DECAY ** (depth + 1 - g["layer"]))
    heads = [n for n in ids if n.split(".")[0] in model.classifier_names]
    assert heads and all(ids[n] == depth + 1 for n in heads)
    assert all(ids[n] == 0 for n in ids if n.split(".")[0] in ("patch_embed", "pos_embed", "cls_token", "conv1"))
    counts = {}
    for g in groups:
        counts[(g["layer"], g["weight_decay"] == 0)] = len(g["params"])
    assert sum(counts.values()) == sum(p.requires_grad for p in model.parameters())  # airbench fixes some
    per_layer = {}
    for name in (n for n, p in model.named_parameters() if p.requires_grad):
        per_layer[ids[name]] = per_layer.get(ids[name], 0) + 1
    assert {layer: sum(n for (lay, _), n in counts.items() if lay == layer) for layer in per_layer} == per_layer
    said = next(line for line in lines if line.startswith("layer decay"))
    assert said == (f"layer decay 0.5: {depth + 2} layers in {len(groups)} parameter groups, "
                    f"lr scale {DECAY ** (depth + 1):.3g}..1"), said


@pytest.mark.parametrize("family", ["vit", "cait", "hybrid", "resnet"])
def test_frozen_blocks_do_not_change(family, folder, tmp_path, cache_dir):
    init = pretrained(family, tmp_path / "init")
    out = tmp_path / "run"
    lines = []
    train(load_recipe(None, data=str(folder), init=str(init), freeze_blocks=1, layer_decay=0.7, lr=0.01,
                      out=str(out), **QUICK), log=lines.append)
    before, after = vitlab.load(init), vitlab.load(out)
    ids, _ = layer_ids(after)
    old = dict(before.named_parameters())
    for name, p in after.named_parameters():
        if ids[name] <= 1:
            assert torch.equal(p, old[name]), name
    block = [n for n in ids if ids[n] == 2 and n.endswith("weight")]
    assert any(not torch.equal(dict(after.named_parameters())[n], old[n]) for n in block)
    groups = load_checkpoint(out)["optimizer"]["param_groups"]
    assert min(g["layer"] for g in groups) == 2  # frozen parameters have no group
    assert any(line.startswith("frozen: the embeddings and the first 1 blocks") for line in lines), lines


def test_new_head_starts_at_zero_by_default():
    model = FAMILY["deit"].create(num_classes=5)
    model.pretrained_cfg["label_names"] = list("abcde")
    lines = []
    fit_head(model, ["x", "y", "z"], "auto", lines.append)
    assert model.num_classes == 3
    for head in (model.head, model.head_dist):
        assert head.out_features == 3 and not head.weight.any() and not head.bias.any()
    assert lines == ["new head(s) for 3 classes, initialised zero"]


def test_head_of_the_same_classes_is_kept_unless_asked():
    model = FAMILY["vit"].create(num_classes=3)
    model.pretrained_cfg["label_names"] = ["x", "y", "z"]
    weight = model.head.weight.detach().clone()
    lines = []
    fit_head(model, ["x", "y", "z"], "auto", lines.append)
    assert torch.equal(model.head.weight, weight) and lines == ["kept the head of --init: it predicts the data's 3 "
                                                                "classes"]
    fit_head(model, ["x", "y", "z"], "keep", lines.append)
    assert torch.equal(model.head.weight, weight)
    fit_head(model, ["x", "y", "z"], "trunc_normal", lines.append)
    w = model.head.weight
    assert not torch.equal(w, weight) and w.any() and w.abs().max() < 1.5e-4 and not model.head.bias.any()  # std 2e-5


def test_keep_refuses_a_head_of_other_classes():
    model = FAMILY["vit"].create(num_classes=3)
    model.pretrained_cfg["label_names"] = ["x", "y", "z"]
    with pytest.raises(ValueError, match=r"it predicts 3 \(x, y, z\), the data has 2 \(x, y\); accepted here: "
                                         r"auto, zero, trunc_normal"):
        fit_head(model, ["x", "y"], "keep", print)
    assert model.num_classes == 3


def stop_at(line_start: str):
    """A log that interrupts the run when a line starts with ``line_start`` (as a kill would, between epochs)."""
    def log(line: str) -> None:
        if line.startswith(line_start):
            raise KeyboardInterrupt
    return log


def test_resume_keeps_the_scales_and_refuses_other_groups(folder, tmp_path, cache_dir):
    init = pretrained("vit", tmp_path / "init")
    out, other = tmp_path / "run", tmp_path / "other"
    # lr 1e-6 leaves the zero head's predictions (and the test top-1) as they are: the plateau scales the lr
    recipe = dict(data=str(folder), init=str(init), layer_decay=DECAY, plateau_patience=1, plateau_factor=0.5,
                  lr=1e-6, min_lr=0.0, out=str(out), **{**QUICK, "epochs": 3})
    with pytest.raises(KeyboardInterrupt):
        train(load_recipe(None, **recipe), log=stop_at("epoch 2:"))  # the checkpoint of epoch 1 stays
    first = load_checkpoint(out)["optimizer"]["param_groups"]
    shutil.copytree(out, other)
    train(load_recipe(None, **recipe), resume=True)
    ckpt = load_checkpoint(out)
    groups = ckpt["optimizer"]["param_groups"]
    assert [(g["lr_scale"], g["layer"], len(g["params"])) for g in groups] == \
           [(g["lr_scale"], g["layer"], len(g["params"])) for g in first]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and ckpt["plateau"]["scale"] == 0.25  # lowered after the second and third evaluations
    for g in groups:
        assert g["lr"] == pytest.approx(rows[-1]["lr"] * g["lr_scale"])
    steps = rows[-1]["step"]  # the last step's lr: the cosine's, times the plateau's scale after epoch 2
    assert rows[-1]["lr"] == pytest.approx(warmup_cosine((steps - 1) / steps, 1e-6, 0.0, 0.0) * 0.5)
    # the config edited to another decay (which would make other groups) is refused in one line
    config = yaml.safe_load((other / "config.yaml").read_text())
    (other / "config.yaml").write_text(yaml.safe_dump({**config, "layer_decay": 1.0, "out": str(other)}))
    with pytest.raises(ValueError, match=r"config.yaml is not the recipe .*checkpoint.pt was trained with "
                                         r"\(layer_decay 0.5 -> 1.0\)"):
        train(load_recipe(other / "config.yaml"), resume=True)


@pytest.mark.parametrize("args, message", [
    (["--head-init", "zero"], "head_init='zero' applies to a pretrained model: give --init MODEL"),
    (["--freeze-blocks", "2"], "freeze_blocks=2 applies to a pretrained model"),
    (["--init", "INIT", "--freeze-blocks", "2", "--freeze-backbone"], "freeze_blocks=2 is not valid with "
                                                                      "freeze_backbone"),
    (["--init", "INIT", "--layer-decay", "0.7", "--freeze-backbone"], "layer_decay=0.7 is not valid with "
                                                                      "freeze_backbone"),
    (["--init", "INIT", "--layer-decay", "1.5"], "layer_decay=1.5 is not valid; accepted: a number > 0 and <= 1"),
    (["--init", "INIT", "--head-init", "xavier"], "accepted: auto, zero, trunc_normal, keep"),
    (["--init", "INIT", "--freeze-blocks", "5"], r"cannot freeze 5 blocks of VisionTransformer: it has 2 "
                                                 r"\(accepted 0\.\.2\)"),
    (["--init", "INIT", "--head-init", "keep"], "head_init 'keep' needs --init to predict the data's classes"),
])
def test_options_that_make_no_sense_together_are_one_line(args, message, folder, tmp_path, cache_dir, capsys):
    init = pretrained("vit", tmp_path / "init")
    args = [str(init) if a == "INIT" else a for a in args]
    code = main(["train", "--data", str(folder), "--epochs", "1", "--threads", "1", *args,
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and last.startswith("vitlab train: error: "), err
    assert re.search(message, last), err
    assert not (tmp_path / "run" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------
# small data: every image every epoch, no step at lr 0

@pytest.mark.parametrize("n, batch, unit, plan", [
    (165, 128, 1, (83, 2)), (1437, 32, 1, (32, 45)), (36, 128, 1, (36, 1)), (256, 128, 1, (128, 2)),
    (5, 4, 4, (5, 1)), (50000, 128, 2, (128, 391)),
])
def test_epoch_plan_uses_every_image_in_near_equal_batches(n, batch, unit, plan):
    largest, steps = epoch_plan(n, batch, unit)
    assert (largest, steps) == plan
    sizes = [len(b) for b in torch.arange(n).tensor_split(steps)]  # how the trainer cuts an epoch's order
    assert sum(sizes) == n and max(sizes) == largest and max(sizes) - min(sizes) <= 1
    assert largest <= batch or steps == 1
    assert min(sizes) >= unit or steps == 1


def test_warmup_first_step_learns_and_reaches_the_peak_after_warmup():
    total = 10  # warmup 0.3: three warmup steps, then the cosine from its peak
    lrs = [warmup_cosine(k / total, 1.0, 0.0, 0.3, step_share(k / total, k, total)) for k in range(total)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))
    assert warmup_cosine(0.0, 1.0, 0.0, 0.05, 0.5) == pytest.approx(0.5 / 0.55)  # warmup under one step
    assert step_share(0.3, 6, 100) == pytest.approx(0.05)  # a time budget: the progress per step so far
    assert describe_warmup(0.3, 10, 1.0, 0.0) == "warmup over the first 3 of 10 steps, lr 0.25 to 1"
    assert describe_warmup(0.05, 4, 1e-3, 0.0) == "warmup 0.05 of 4 steps spans one step, at lr 0.000833"
    assert describe_warmup(0.0, 4, 1e-3, 0.0) is None


def test_small_folder_uses_every_image_every_epoch(tmp_path, cache_dir, monkeypatch):
    import vitlab.train.trainer as trainer

    data = noise_folder(tmp_path / "small", classes=3, per_class=69, size=8)  # 165 training images, 42 test
    seen, lrs, real_step = [], [], trainer.train_step

    def step(stepper, batch):
        seen.append([bytes(image.cpu().numpy()) for image in batch.images])  # noise: every image is distinct
        lrs.append(stepper.optimizer.param_groups[0]["lr"])
        return real_step(stepper, batch)

    monkeypatch.setattr(trainer, "train_step", step)
    lines = []
    summary = train(load_recipe(None, data=str(data), model="vit_micro_patch2_8", model_args={"in_chans": 3},
                                epochs=3, precision="fp32", threads=1, out=str(tmp_path / "run")), log=lines.append)
    assert summary["num_train"] == 165 and summary["steps"] == 6
    assert [len(s) for s in seen] == [83, 82] * 3
    assert len(set(seen[0] + seen[1])) == 165
    for epoch in range(3):  # every image once an epoch
        assert sorted(seen[2 * epoch] + seen[2 * epoch + 1]) == sorted(seen[0] + seen[1])
    assert lrs[0] > 0 and lrs[0] == pytest.approx(1e-3 * (1 / 6) / (0.05 + 1 / 6))
    assert ("batches of 82-83 images, 2 steps an epoch: every one of the 165 training images is used every epoch "
            "(batch_size 128 at most)") in lines, lines
    assert "warmup 0.05 of 6 steps spans one step, at lr 0.000769" in lines, lines
