"""The model zoo: parity with timm/HF fixtures, every registered model, fused vs slow attention, any resolution."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ATTENTION_FAMILIES, FAMILY, PARITY
from safetensors.torch import load_file

import vitlab
from vitlab.models import Cait, ConVit, VisionTransformer
from vitlab.models.layers import ParallelScalingBlock, resample_abs_pos_embed, to_2tuple
from vitlab.models.registry import accepted_args, get_spec
from vitlab.models.vit import TIMM_PRESETS

FIXTURES = sorted(p.name for p in PARITY.glob("*") if (p / "io.safetensors").exists())


def test_fixtures_present():
    assert len(FIXTURES) >= 8, f"parity fixtures missing under {PARITY}"


@pytest.mark.parametrize("name", FIXTURES)
def test_parity_fixture(name):
    model = vitlab.load(PARITY / name)
    io = load_file(PARITY / name / "io.safetensors")
    with torch.no_grad():
        feats = model.forward_features(io["input"])
        logits = model.forward_head(feats)
        torch.testing.assert_close(logits, io["logits"], atol=1e-4, rtol=0)
        if "features" in io:
            torch.testing.assert_close(feats, io["features"], atol=1e-4, rtol=0)
        if "logits_cls" in io:
            model.train()  # distilled: both heads in training (no dropout in these configs)
            cls, dist = model(io["input"])
            torch.testing.assert_close(cls, io["logits_cls"], atol=1e-4, rtol=0)
            torch.testing.assert_close(dist, io["logits_dist"], atol=1e-4, rtol=0)


def _small_input_args(name):
    """Overrides that keep a registered model's architecture but shrink its input."""
    args = get_spec(name).args
    if max(to_2tuple(args.get("img_size", 224))) <= 32 or "layers" in args:
        return {"num_classes": 7} if "layers" in args else {}
    stride = args.get("patch_size") or 16
    if "backbone_layers" in args:  # ResNetV2 hybrids: the projection's kernel sits on the backbone's reduced map
        stride *= 2 ** (2 + max(len(args["backbone_layers"]) - 1, 0))
    # today's backbones, and any model as wide and deep as ViT-B or more (a 7B DINOv3 would take tens of GB, and
    # the sixty ViT-B and ViT-L names minutes): their options at two blocks of 8 channels per head; each is built at
    # its real size on the meta device by test_registered_models_carry_consistent_facts
    big = args.get("embed_dim", 0) * args.get("depth", 0) >= 768 * 12
    if name.startswith("gemma4_vit_"):  # a grid its encoder's 3x3 soft-token cells split
        stride *= 3
    # an encoder whose output is tokens (Qwen3's, Gemma 4's and DeepSeek's _enc) keeps num_classes 0
    classes = {} if args.get("encoder_only") else {"num_classes": 7}
    if name in TIMM_PRESETS or name.startswith(("naflexvit_", "qwen3_vit_", "gemma4_vit_", "deepseek_vit_")) or big:
        kv = args.get("num_kv_heads")  # per block (Sapiens2): the first block's and the middle one's
        kv = {"num_kv_heads": (kv[0], kv[len(kv) // 2])} if isinstance(kv, tuple) else {}
        return {"img_size": 2 * stride, **classes, "depth": 2, "embed_dim": 8 * args["num_heads"], **kv}
    return {"img_size": 2 * stride, "num_classes": 7}


@pytest.mark.parametrize("name", vitlab.list_models())
def test_every_model_forward_backward(name):
    model = vitlab.create_model(name, **_small_input_args(name))
    c, h, w = model.pretrained_cfg["input_size"]
    if "layers" in get_spec(name).args:  # ResNets: any size
        h = w = 32
    x = torch.randn(2, c, h, w)
    model.train()
    out = model(x)
    outs = out if isinstance(out, tuple) else (out,)
    tokens = getattr(model, "encoder_only", False)  # (B, merged tokens, width): what a language model reads
    assert all(o.shape[0] == 2 and o.ndim == 3 if tokens else o.shape == (2, model.num_classes) for o in outs)
    sum(o.square().mean() for o in outs).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert torch.isfinite(feats).all()
        assert feats.shape[0] == 2


def _perturb(model):
    """Noise on every parameter, so that gates, LayerScale and zero-initialised heads all matter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _capture(model):
    """Attention tensors passing through every attn_map hook point, in forward order."""
    maps, handles = [], []
    for name, module in model.named_modules():
        if name.endswith("attn_map"):
            handles.append(module.register_forward_hook(
                lambda m, i, o, name=name: maps.append((name, type(m), o.detach()))))
    return maps, handles


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_slow_path_equals_fused_and_rows_sum_to_one(family):
    model = _perturb(FAMILY[family].create()).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        fused = model(x)
        attn_modules = [m for m in model.modules() if hasattr(m, "fused_attn")]
        assert attn_modules, "every family has at least one module with a fused path"
        for m in attn_modules:
            m.fused_attn = False
        maps, handles = _capture(model)
        slow = model(x)
        for h in handles:
            h.remove()
    torch.testing.assert_close(slow, fused, atol=1e-5, rtol=1e-5)
    n_attn = sum(1 for n, m in model.named_modules()  # SigLIP's head; a ViT-22B block is its own attention
                 if n.endswith(".attn") or n == "attn_pool" or isinstance(m, ParallelScalingBlock))
    assert len(maps) == n_attn, "the slow path exposes every block's (and an attention pool's) attention"
    for name, _, a in maps:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if type(owner).__name__ == "TalkingHeadAttn":
            # after the post-softmax head mixing, rows sum to proj_w's row sums plus N times its bias
            n_keys = a.shape[-1]
            expect = owner.proj_w.weight.sum(1) + n_keys * owner.proj_w.bias
            torch.testing.assert_close(a.sum(-1), expect.view(1, -1, 1).expand_as(a.sum(-1)), atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), atol=1e-5, rtol=0)
            assert (a >= 0).all()


@pytest.mark.parametrize("family", FAMILY)
def test_save_load_roundtrip_exact(family, tmp_path):
    model = _perturb(FAMILY[family].create()).eval()
    model.pretrained_cfg["label_names"] = [f"class {i}" for i in range(model.num_classes)]
    vitlab.save(model, tmp_path / "m")
    loaded = vitlab.load(tmp_path / "m")
    assert type(loaded) is type(model)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert loaded.pretrained_cfg["label_names"] == model.pretrained_cfg["label_names"]


def test_deit_returns_both_heads_in_training_and_their_mean_in_eval():
    model = _perturb(FAMILY["deit"].create())
    x = torch.randn(2, 3, 32, 32)
    model.train()
    cls, dist = model(x)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), (cls + dist).detach() / 2)
        assert not torch.allclose(cls, dist)


def test_reset_classifier_replaces_both_heads():
    model = FAMILY["deit"].create()
    model.reset_classifier(4)
    assert model.head.out_features == 4 and model.head_dist.out_features == 4
    model.eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)


def test_deit_forward_heads_gives_both_heads_in_eval_too():
    model = _perturb(FAMILY["deit"].create()).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        cls, dist = model.forward_heads(model.forward_features(x))
        torch.testing.assert_close((cls + dist) / 2, model(x))
        assert not torch.allclose(cls, dist)


def test_cct_tokens_and_sequence_pooling():
    """CCT: the convolutional tokenizer's grid (the paper's 256, 64 and 196 tokens), a softmax-weighted token mean."""
    with torch.device("meta"):
        grids = [vitlab.create_model(n).patch_embed.grid_size
                 for n in ("cct_7_3x1_32", "cct_7_3x2_32", "cct_14_7x2_224")]
    assert grids == [(16, 16), (8, 8), (14, 14)]
    model = _perturb(FAMILY["cct"].create()).eval()
    tokens = torch.randn(2, 64, 32)
    weights = model.attention_pool(tokens).softmax(dim=1)
    torch.testing.assert_close(model.pool(tokens), (weights * tokens).sum(dim=1))
    assert model.pool(tokens[:, :1].expand(2, 64, 32)).allclose(tokens[:, 0], atol=1e-6)
    with pytest.raises(ValueError, match="not divisible by the patch size 4"):
        vitlab.create_model("cct_7_3x2_32", img_size=30)


# --- one head API and the facts every family carries -----------------------------------------------


@pytest.mark.parametrize("family", FAMILY)
def test_every_family_has_timms_head_api(family):
    model = _perturb(FAMILY[family].create())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.eval()
        feats = model.forward_features(x)
        assert model.forward_head(feats, pre_logits=True).shape == (2, model.num_features)
        assert [len(h) for h in model.forward_heads(feats)] == [2] * len(model.classifier_names)
        model.reset_classifier(3)
        assert model.get_classifier() is getattr(model, model.classifier_names[0])
        assert all(getattr(model, n).out_features == 3 for n in model.classifier_names)
        assert model(x).shape == (2, 3) and model.num_classes == 3
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)
    tables = {n for n in ("pos_embed", "cls_token", "dist_token", "reg_token")
              if isinstance(getattr(model, n, None), torch.nn.Parameter)}
    tables |= {n for n, _ in model.named_parameters() if n.endswith("position_embedding_table")}  # Gemma 4's
    no_table = ("resnet", "airbench", "mixer", "deepseek", "deepseek_align")  # CNNs, the Mixer, RoPE alone (DeepSeek)
    assert tables <= model.no_weight_decay() and (tables or family in no_table)
    with pytest.raises(ValueError, match="accepted"):
        model.reset_classifier(3, global_pool="median")


@pytest.mark.parametrize("name", vitlab.list_models())
def test_registered_models_carry_consistent_facts(name):
    """The facts interop and reports read: a family label, classifier layers, timm's and transformers' names."""
    spec = get_spec(name)
    with torch.device("meta"):
        model = vitlab.create_model(name)
    assert model.family and model.classifier_names
    assert all(isinstance(getattr(model, n), torch.nn.Linear) for n in model.classifier_names) or (
        getattr(model, "encoder_only", False) and model.num_classes == 0)  # Qwen3's _enc: tokens out, no head
    timm = model.timm_spec
    if timm is None:
        assert model.no_timm and name not in type(model).timm_names
    else:
        accepted = accepted_args(spec.cls)
        assert set(timm.args) | set(timm.fixed) | set(timm.dropped) <= set(accepted)
        assert get_spec(timm.base_arch).cls is spec.cls
        assert all(get_spec(n).cls is spec.cls for n in type(model).timm_names)
    # a transformers model_type vitlab writes (ViT, DeiT, BEiT, DINOv3, AIMv2), or why transformers cannot hold it
    assert model.hf_model_type in ("vit", "deit", "beit", "dinov3_vit", "siglip2_vision_model",
                                   "aimv2_vision_model") or (
        model.hf_model_type is None and model.no_hf)


# --- any resolution -------------------------------------------------------------------------


def test_load_with_new_img_size_resamples_pos_embed_bicubic():
    src = PARITY / "timm_vit_token"
    base = vitlab.load(src)
    big = vitlab.load(src, img_size=48)
    assert big.patch_embed.grid_size == (6, 6)
    pe = base.pos_embed.detach()
    grid = pe[:, 1:].reshape(1, 4, 4, -1).permute(0, 3, 1, 2)
    expect = F.interpolate(grid, size=(6, 6), mode="bicubic", antialias=True).permute(0, 2, 3, 1).reshape(1, 36, -1)
    torch.testing.assert_close(big.pos_embed[:, 1:].detach(), expect)
    torch.testing.assert_close(big.pos_embed[:, :1], base.pos_embed[:, :1])
    assert big(torch.randn(1, 3, 48, 48)).shape == (1, 5)


@pytest.mark.parametrize("fixture", ["timm_vit_token", "timm_deit_distilled", "timm_convit", "timm_cait",
                                     "hf_vit", "hf_deit_distilled", "timm_vit_avg_noclass"])
def test_dynamic_img_size_matches_a_model_built_for_that_size(fixture):
    """Run-time resampling (dynamic_img_size) equals resampling on load (img_size=), non-square too."""
    dyn = vitlab.load(PARITY / fixture, dynamic_img_size=True)
    fixed = vitlab.load(PARITY / fixture, img_size=(48, 24))
    x = torch.randn(2, 3, 48, 24)
    with torch.no_grad():
        torch.testing.assert_close(dyn(x), fixed(x), atol=1e-5, rtol=1e-5)
        # at the native size nothing is resampled
        io = load_file(PARITY / fixture / "io.safetensors")
        torch.testing.assert_close(dyn(io["input"]), io["logits"], atol=1e-4, rtol=0)


def test_wrong_input_size_is_a_clear_error():
    model = vitlab.create_model("vit_tiny_patch4_32")
    with pytest.raises(ValueError, match="does not match the model's 32x32"):
        model(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, H, W\)"):
        model(torch.randn(1, 1, 32, 32))


def test_resample_keeps_prefix_tokens_apart():
    pe = torch.randn(1, 2 + 16, 8)
    out = resample_abs_pos_embed(pe, (2, 8), (4, 4), num_prefix_tokens=2)
    assert out.shape == (1, 2 + 16, 8)
    assert torch.equal(out[:, :2], pe[:, :2])


# --- configurations beyond the fixtures -------------------------------------------------------


def test_one_input_channel_and_no_qkv_bias():
    model = vitlab.create_model("vit_tiny_patch4_32", in_chans=1, qkv_bias=False, embed_dim=48, num_heads=3, depth=2)
    assert model.blocks[0].attn.qkv.bias is None
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_convit_nine_heads_local_init_is_a_3x3_kernel():
    model = ConVit(img_size=32, patch_size=4, embed_dim=8, num_heads=9, depth=2, local_up_to_layer=1, num_classes=3)
    gpsa = model.blocks[0].attn
    # each head's positional attention peaks at one of the 9 offsets of a 3x3 kernel
    pos = gpsa.pos_proj(gpsa._rel_indices(64)).permute(0, 3, 1, 2).softmax(-1)[0]  # (H, N, N)
    centre = 3 * 8 + 3  # a query away from the border
    peaks = {(int(pos[h, centre].argmax()) // 8 - 3, int(pos[h, centre].argmax()) % 8 - 3) for h in range(9)}
    assert peaks == {(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}


def test_convit_class_token_joins_after_local_blocks():
    model = _perturb(ConVit(img_size=16, patch_size=4, embed_dim=8, num_heads=4, depth=3, local_up_to_layer=2,
                            num_classes=3)).eval()
    seen = []
    for blk in model.blocks:
        blk.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    model(torch.randn(1, 3, 16, 16))
    assert seen == [16, 16, 17]


def test_cait_class_attention_leaves_patch_tokens_alone():
    model = _perturb(Cait(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, depth_token_only=2,
                          num_classes=3, init_values=0.1)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        feats = model.forward_features(x)
        patches = model.norm(model.blocks(model.patch_embed(x).reshape(2, 16, 24) + model.pos_embed))
    torch.testing.assert_close(feats[:, 1:], patches)


def test_sincos_pos_embed_is_fixed():
    model = vitlab.create_model("vit_tiny_sincos_patch4_32")
    assert not model.pos_embed.requires_grad
    assert torch.equal(model.pos_embed[0, 0], torch.zeros(192))  # the class token's entry


def test_hf_config_without_qkv_bias_loads(tmp_path):
    """A Hub-format ViT folder written from a vitlab model (the Hub's key names) gives the same outputs."""
    model = _perturb(VisionTransformer(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=4,
                                       qkv_bias=False, norm_eps=1e-12)).eval()
    sd, hub = model.state_dict(), {}
    hub["vit.embeddings.cls_token"] = sd["cls_token"]
    hub["vit.embeddings.position_embeddings"] = sd["pos_embed"]
    for p in ("weight", "bias"):
        hub[f"vit.embeddings.patch_embeddings.projection.{p}"] = sd[f"patch_embed.proj.{p}"]
        hub[f"vit.layernorm.{p}"] = sd[f"norm.{p}"]
        hub[f"classifier.{p}"] = sd[f"head.{p}"]
    for i in range(2):
        pre = f"vit.encoder.layer.{i}."
        q, k, v = sd[f"blocks.{i}.attn.qkv.weight"].chunk(3)
        hub.update({pre + "attention.attention.query.weight": q, pre + "attention.attention.key.weight": k,
                    pre + "attention.attention.value.weight": v})
        for p in ("weight", "bias"):
            hub[pre + f"attention.output.dense.{p}"] = sd[f"blocks.{i}.attn.proj.{p}"]
            hub[pre + f"intermediate.dense.{p}"] = sd[f"blocks.{i}.mlp.fc1.{p}"]
            hub[pre + f"output.dense.{p}"] = sd[f"blocks.{i}.mlp.fc2.{p}"]
            hub[pre + f"layernorm_before.{p}"] = sd[f"blocks.{i}.norm1.{p}"]
            hub[pre + f"layernorm_after.{p}"] = sd[f"blocks.{i}.norm2.{p}"]
    folder = tmp_path / "hub"
    folder.mkdir()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in hub.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 96, "hidden_act": "gelu",
        "layer_norm_eps": 1e-12, "image_size": 16, "patch_size": 4, "num_channels": 3, "qkv_bias": False,
        "id2label": {str(i): f"c{i}" for i in range(4)}}))
    loaded = vitlab.load(folder)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=1e-5, rtol=0)
    assert loaded.pretrained_cfg["label_names"] == ["c0", "c1", "c2", "c3"]


def test_model_table_reads_the_counted_facts_without_building_a_model(tmp_path):
    from vitlab import catalog
    table = catalog.model_table("deit*").splitlines()
    assert table[0].split() == ["model", "class", "input", "params", "(M)", "GMACs"]
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert rows["deit_base_patch16_224"][2:] == ["224x224", "86.57", "17.56"]  # DeiT-B: 86M, 17.6 GMACs (timm, DeiT)
    assert rows["deit_tiny_patch16_224"][2:] == ["224x224", "5.72", "1.25"]  # DeiT-Ti: 5.7M, 1.3 GMACs
    assert list(rows) == vitlab.list_models("deit*")  # the registry's names, in its order
    assert catalog.model_table("no_such_model*") == "no model matches 'no_such_model*'"
    with pytest.raises(ValueError, match="missing or unreadable"):
        catalog.model_table("deit*", path=tmp_path / "facts.json")


@pytest.mark.slow
def test_vitlab_models_lists_without_importing_torch():
    import subprocess
    import sys
    code = ("import sys; from vitlab.cli import main; main(['models', 'deit_base_patch16_224']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "17.56" in out.splitlines()[2] and out.splitlines()[-1] == "[]"


def test_models_missing_from_the_facts_are_counted_with_progress_on_long_lists(monkeypatch):
    import io

    from vitlab.models import summary
    names = ["deit_tiny_distilled_patch4_32", "vit_micro_patch2_8", "vit_nano_patch4_32"]
    log = io.StringIO()
    counted = summary.model_facts(names, progress_from=3, file=log, facts={})
    assert "counting parameters and multiply-adds" in log.getvalue() and "3/3" in log.getvalue()
    assert counted == [{"name": n, **summary.read_facts()[n]} for n in names]  # the table holds what counting gives
    stale = {n: {**summary.read_facts()[n], "spec": "another"} for n in names}
    log = io.StringIO()
    assert summary.model_facts(names, progress_from=4, file=log, facts=stale) == counted and log.getvalue() == ""


def test_the_counted_facts_cover_every_registered_model_as_registered_now():
    from vitlab.models import summary
    facts = summary.read_facts()
    stale = [n for n in vitlab.list_models("*") if facts.get(n, {}).get("spec") != summary.spec_key(n)]
    assert not stale, f"{len(stale)} models' facts missing or stale ({stale[:3]}): run benchmarks/make_model_facts.py"
