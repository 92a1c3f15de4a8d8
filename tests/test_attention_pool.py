"""SigLIP's attention-pool head (global_pool='map') in the attention analyses: its learned query is captured and is
what rollout, relevance and raw attention read, as the class token's row is read in a ViT."""
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.analysis.capture import attention_maps
from vitlab.analysis.distance import distance_layer_names
from vitlab.analysis.relevance import relevance_from_maps
from vitlab.analysis.rollout import raw_attention, rollout

SIGLIP = Path(__file__).parent / "fixtures" / "parity" / "timm_siglip"


@pytest.fixture
def siglip():
    return vitlab.load(SIGLIP).eval()


def test_the_pooling_query_is_captured_without_changing_the_output(siglip):
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        fused = siglip(x)
    maps = attention_maps(siglip, x)
    assert [(m.name, m.kind) for m in maps] == [("blocks.0", "mhsa"), ("blocks.1", "mhsa"), ("attn_pool", "attn_pool")]
    pool = maps[-1].attn
    assert pool.shape == (2, 2, 1, 16) and torch.allclose(pool.sum(-1), torch.ones(2, 2, 1))
    with torch.no_grad():
        assert torch.allclose(siglip(x), fused, atol=1e-5)
    assert "attn_pool" not in [name for name, _ in distance_layer_names(siglip)]  # one query: no distance


def test_rollout_relevance_and_raw_attention_read_the_pooling_query(siglip):
    x = torch.randn(2, 3, 16, 16)
    maps = attention_maps(siglip, x)
    result = torch.eye(16).expand(2, 16, 16)
    for m in maps[:-1]:
        a = m.attn.mean(1) + torch.eye(16)
        result = (a / a.sum(-1, keepdim=True)) @ result
    pool = maps[-1].attn.mean(1)  # (B, 1, N)
    expected = (pool @ result)[:, 0]
    expected = expected / expected.amax(-1, keepdim=True)
    assert torch.allclose(rollout(maps), expected.reshape(2, 4, 4), atol=1e-5)
    patch_mean = result.mean(1)  # what a model without a class token is read as: not this model's readout
    assert not torch.allclose(rollout(maps), (patch_mean / patch_mean.amax(-1, keepdim=True)).reshape(2, 4, 4),
                              atol=1e-3)
    raw = pool[:, 0] / pool[:, 0].amax(-1, keepdim=True)
    assert torch.allclose(raw_attention(maps), raw.reshape(2, 4, 4), atol=1e-6)
    ones = [torch.ones_like(m.attn) for m in maps]  # unit gradients: relevance = pool row @ (I + A2)(I + A1)
    R = torch.eye(16).repeat(2, 1, 1)
    for m in maps[:-1]:
        R = R + m.attn.mean(1) @ R
    rel = (pool @ R)[:, 0]
    rel = (rel - rel.amin(-1, keepdim=True)) / (rel.amax(-1, keepdim=True) - rel.amin(-1, keepdim=True))
    assert torch.allclose(relevance_from_maps(maps, ones), rel.reshape(2, 4, 4), atol=1e-5)
