"""Layer-wise lr decay, head initialisation and block freezing over every model family."""
import re

import pytest
import torch
import torch.nn as nn

import vitlab
from vitlab.models.groups import layer_ids
from vitlab.train.finetune import HEAD_INIT_STD, freeze_blocks, init_head
from vitlab.train.optim import param_groups, param_groups_layer_decay
from vitlab.train.schedule import set_lr

DECAY, LR, WD = 0.5, 1e-3, 0.05

# name, create_model overrides, depth, {parameter: layer id} written out by hand (BEiT's numbering:
# embeddings 0, block i -> i + 1, final norm and heads depth + 1)
FAMILIES = {
    "vit": ("vit_nano_patch4_32", {}, 4, {
        "patch_embed.proj.weight": 0, "pos_embed": 0, "cls_token": 0, "blocks.0.attn.qkv.weight": 1,
        "blocks.3.mlp.fc2.bias": 4, "norm.weight": 5, "head.weight": 5, "head.bias": 5}),
    "vit_reg_gap": ("vit_nano_patch4_32", {"reg_tokens": 4, "global_pool": "avg", "class_token": False}, 4, {
        "reg_token": 0, "pos_embed": 0, "blocks.1.norm1.weight": 2, "fc_norm.weight": 5, "head.weight": 5}),
    "deit": ("deit_nano_distilled_patch4_32", {}, 4, {
        "cls_token": 0, "dist_token": 0, "blocks.2.attn.proj.weight": 3, "head.weight": 5, "head_dist.weight": 5}),
    "cait": ("cait_xxs_patch4_32", {}, 10, {  # 8 self-attention blocks, then 2 class-attention blocks
        "cls_token": 0, "pos_embed": 0, "blocks.0.attn.proj_l.weight": 1, "blocks.7.mlp.fc1.weight": 8,
        "blocks_token_only.0.attn.q.weight": 9, "blocks_token_only.1.ls2.gamma": 10, "norm.weight": 11,
        "head.weight": 11}),
    "convit": ("convit_nano_patch4_32", {}, 4, {
        "cls_token": 0, "pos_embed": 0, "blocks.0.attn.gating_param": 1, "blocks.3.attn.qkv.weight": 4,
        "head.bias": 5}),
    "hybrid": ("vit_nano_r18_32", {}, 4, {
        "patch_embed.backbone.conv1.weight": 0, "patch_embed.backbone.layer1.0.conv1.weight": 0,
        "patch_embed.proj.weight": 0, "blocks.0.attn.qkv.weight": 1, "head.weight": 5}),
    "resnet": ("resnet10_32", {}, 4, {
        "conv1.weight": 0, "bn1.weight": 0, "layer1.0.conv1.weight": 1, "layer4.0.downsample.0.weight": 4,
        "fc.weight": 5, "fc.bias": 5}),
    "airbench": ("airbench_32", {"widths": (8, 16, 16)}, 3, {  # the whitening is the embedding, a conv group a layer
        "stem.whiten.bias": 0, "stem.groups.0.conv1.weight": 1, "stem.groups.2.norm2.bias": 3, "head.weight": 4}),
    "airbench_hybrid": ("vit_nano_airbench_32", {"stem_widths": (8, 16), "depth": 2}, 2, {
        "patch_embed.stem.groups.1.conv1.weight": 0, "patch_embed.proj.weight": 0, "blocks.1.attn.qkv.weight": 2,
        "head.weight": 3}),
}


def make(family):
    name, args, _, _ = FAMILIES[family]
    return vitlab.create_model(name, num_classes=7, **args)


def lr_of(optimizer):
    return {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_ids_follow_beit_numbering(family):
    model = make(family)
    ids, depth = layer_ids(model)
    assert depth == FAMILIES[family][2]
    for name, layer in FAMILIES[family][3].items():
        assert ids[name] == layer, name
    assert set(ids) == {n for n, _ in model.named_parameters()}
    assert set(ids.values()) == set(range(depth + 2))  # every layer holds parameters


@pytest.mark.parametrize("family", FAMILIES)
def test_learning_rates_follow_decay_per_layer(family):
    model = make(family)
    depth, expected = FAMILIES[family][2], FAMILIES[family][3]
    optimizer = torch.optim.AdamW(param_groups_layer_decay(model, WD, DECAY), lr=LR)
    set_lr(optimizer, LR)
    lrs = lr_of(optimizer)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # airbench fixes its BatchNorm scales
    for name, layer in expected.items():
        assert lrs[id(params[name])] == pytest.approx(LR * DECAY ** (depth + 1 - layer)), name
    # the heads learn at the full rate, the last block at lr * decay, the embeddings at lr * decay^(depth + 1)
    ids, _ = layer_ids(model)
    for name, p in params.items():
        assert lrs[id(p)] == pytest.approx(LR * DECAY ** (depth + 1 - ids[name])), name
    set_lr(optimizer, 2 * LR)  # a schedule's later value scales every group alike
    assert all(lr_of(optimizer)[k] == pytest.approx(2 * v) for k, v in lrs.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_in_exactly_one_group_and_weight_decay_rule_kept(family):
    model = make(family)
    groups = param_groups_layer_decay(model, WD, DECAY)
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen))
    assert set(seen) == {id(p) for p in model.parameters() if p.requires_grad}
    no_decay = {id(p) for p in param_groups(model, WD)[1]["params"]}
    for g in groups:
        assert g["weight_decay"] == (0.0 if id(g["params"][0]) in no_decay else WD)
        assert all((id(p) in no_decay) == (g["weight_decay"] == 0.0) for p in g["params"])
    named = {id(p): n for n, p in model.named_parameters()}
    wd_of = {named[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    assert wd_of[next(n for n in wd_of if n.endswith(".bias"))] == 0.0
    norms = [n for n in wd_of if re.search(r"(norm\d*|bn1)\.weight$", n)]
    assert all(wd_of[n] == 0.0 for n in norms) and (norms or family == "airbench")  # its scales are fixed at 1
    for token in ("pos_embed", "cls_token", "dist_token", "reg_token"):
        if token in wd_of:
            assert wd_of[token] == 0.0
    assert wd_of["head.weight" if "head.weight" in wd_of else "fc.weight"] == WD


@pytest.mark.parametrize("family", ["vit", "deit", "resnet"])
def test_decay_one_reproduces_todays_groups(family):
    model = make(family)
    today = param_groups(model, WD)
    groups = param_groups_layer_decay(model, WD, 1.0)
    assert len(groups) == len(today) == 2
    for g, t in zip(groups, today):
        assert [id(p) for p in g["params"]] == [id(p) for p in t["params"]]
        assert g["weight_decay"] == t["weight_decay"] and g["lr_scale"] == 1.0
    optimizer = torch.optim.AdamW(groups, lr=LR)
    set_lr(optimizer, LR)
    assert all(g["lr"] == LR for g in optimizer.param_groups)


def test_set_lr_without_scales_sets_lr_everywhere():
    model = make("vit")
    optimizer = torch.optim.AdamW(param_groups(model, WD), lr=LR)
    set_lr(optimizer, 3e-4)
    assert [g["lr"] for g in optimizer.param_groups] == [3e-4, 3e-4]


def test_frozen_parameters_stay_out_of_the_groups():
    model = make("vit")
    frozen = set(freeze_blocks(model, 2))
    groups = param_groups_layer_decay(model, WD, DECAY)
    names = {id(p): n for n, p in model.named_parameters()}
    grouped = {names[id(p)] for g in groups for p in g["params"]}
    assert grouped.isdisjoint(frozen) and grouped | frozen == set(names.values())
    assert min(g["layer"] for g in groups) == 3


@pytest.mark.parametrize("decay", [0, -0.5, 1.5, True, "0.7"])
def test_bad_layer_decay_is_one_line_error(decay):
    with pytest.raises(ValueError, match=r"layer decay must be a number in \(0, 1\]") as e:
        param_groups_layer_decay(make("vit"), WD, decay)
    assert "\n" not in str(e.value)


def test_model_without_layers_is_refused():
    with pytest.raises(ValueError, match="neither transformer blocks nor ResNet stages"):
        layer_ids(nn.Linear(3, 2))


# ---------------------------------------------------------------------------------------------------------
# head initialisation

HEADS = {"vit": ["head"], "deit": ["head", "head_dist"], "cait": ["head"], "convit": ["head"],
         "hybrid": ["head"], "resnet": ["fc"]}


@pytest.mark.parametrize("family", HEADS)
def test_zero_head_init_zeroes_every_classifier(family):
    model = make(family).eval()
    before = {n: p.clone() for n, p in model.named_parameters() if n.split(".")[0] not in HEADS[family]}
    assert init_head(model, "zero") == HEADS[family]
    for name in HEADS[family]:
        head = getattr(model, name)
        assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    out = model(torch.randn(2, 3, 32, 32))
    assert torch.equal(out, torch.zeros(2, 7))
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items())  # the backbone is untouched


@pytest.mark.parametrize("family", ["deit", "resnet"])
def test_trunc_normal_head_init(family):
    model = vitlab.create_model(FAMILIES[family][0], num_classes=500)
    init_head(model, "trunc_normal")
    for name in HEADS[family]:
        w, b = getattr(model, name).weight, getattr(model, name).bias
        assert w.std().item() == pytest.approx(HEAD_INIT_STD, rel=0.1)
        assert w.abs().max().item() < 10 * HEAD_INIT_STD and w.mean().abs().item() < HEAD_INIT_STD / 10
        assert torch.count_nonzero(b) == 0
    assert not torch.equal(model.head.weight if family == "deit" else model.fc.weight,
                           torch.zeros_like(model.get_classifier().weight))


def test_head_init_errors():
    with pytest.raises(ValueError, match="'xavier' is not one of zero, trunc_normal"):
        init_head(make("vit"), "xavier")
    with pytest.raises(ValueError, match="no classifier head"):
        init_head(vitlab.create_model("vit_nano_patch4_32", num_classes=0), "zero")


# ---------------------------------------------------------------------------------------------------------
# block freezing

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [0, 1, "depth"])
def test_freeze_blocks_freezes_embeddings_and_first_blocks(family, n):
    model = make(family)
    ids, depth = layer_ids(model)
    fixed = {name for name, p in model.named_parameters() if not p.requires_grad}  # airbench's, from the start
    n = depth if n == "depth" else n
    frozen = freeze_blocks(model, n)
    assert set(frozen) == {name for name, layer in ids.items() if layer <= n}
    model.train()
    out = model(torch.randn(2, 3, 32, 32))
    out = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
    out.backward()
    for name, p in model.named_parameters():
        assert p.requires_grad == (ids[name] > n and name not in fixed), name
        if ids[name] <= n:
            assert p.grad is None, name
    assert model.get_classifier().weight.grad is not None  # the head always trains


@pytest.mark.parametrize("n", [5, -1, 1.5, True])
def test_freeze_blocks_refuses_more_than_depth(n):
    model = make("vit")
    with pytest.raises(ValueError, match=r"it has 4 \(accepted 0\.\.4\)") as e:
        freeze_blocks(model, n)
    assert "\n" not in str(e.value)
    assert all(p.requires_grad for p in model.parameters())  # nothing changed
