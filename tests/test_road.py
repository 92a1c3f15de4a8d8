"""ROAD's noisy linear imputation on a known image."""
import pytest
import torch

from vitlab.analysis.faithfulness import kendall, rank_agreement, spearman
from vitlab.analysis.road import NEIGHBOURS, linear_imputation, noisy_linear_imputation


def _weighted_mean_of_neighbours(img: torch.Tensor, y: int, x: int) -> torch.Tensor:
    """(C,) the mean of pixel (y, x)'s neighbours inside the image, direct ones weighing 1/6, diagonal 1/12."""
    H, W = img.shape[-2:]
    total, weight = torch.zeros(img.shape[0], dtype=img.dtype), 0.0
    for (dy, dx), w in NEIGHBOURS.items():
        if 0 <= y + dy < H and 0 <= x + dx < W:
            total += w * img[:, y + dy, x + dx]
            weight += w
    return total / weight


def test_imputed_pixels_are_the_weighted_mean_of_their_neighbours_plus_the_noise():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(1, 3, 12, 10, generator=g, dtype=torch.float64)
    removed = torch.zeros(1, 1, 12, 10, dtype=torch.bool)
    removed[..., 2:6, 3:8] = True  # a block: removed pixels next to removed pixels
    removed[..., 0, 0] = removed[..., 11, 4] = removed[..., 7, 9] = True  # a corner and two borders
    clean = linear_imputation(img, removed, tol=1e-10)
    assert torch.equal(clean[~removed.expand_as(img)], img[~removed.expand_as(img)])  # kept pixels untouched
    ys, xs = removed[0, 0].nonzero(as_tuple=True)
    for y, x in zip(ys.tolist(), xs.tolist()):
        torch.testing.assert_close(clean[0, :, y, x], _weighted_mean_of_neighbours(clean[0], y, x),
                                   rtol=0, atol=1e-8)
    noisy = noisy_linear_imputation(img, removed, noise=0.01, generator=torch.Generator().manual_seed(1))
    expected_noise = 0.01 * torch.randn(img.shape, generator=torch.Generator().manual_seed(1), dtype=img.dtype)
    torch.testing.assert_close(noisy - linear_imputation(img, removed), expected_noise * removed, rtol=0, atol=1e-12)


def test_imputation_of_a_linear_ramp_is_exact_and_batches_are_independent():
    """A plane is its own neighbours' weighted mean away from the border, so holes in a ramp fill back exactly."""
    ramp = (torch.arange(8.0)[:, None] * 0.5 + torch.arange(8.0)[None, :]).expand(2, 1, 8, 8).clone()
    ramp[1] *= -1
    removed = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    removed[0, :, 2:5, 2:6] = True
    removed[1, :, 3:6, 1:4] = True
    torch.testing.assert_close(linear_imputation(ramp, removed), ramp, rtol=0, atol=1e-4)


def test_rank_correlations_by_hand():
    a, b = [1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0]
    assert spearman(a, b) == pytest.approx(0.8)  # ranks 1 2 3 4 against 1 3 2 4: 1 - 6 * 2 / (4 * 15)
    assert kendall(a, b) == pytest.approx(4 / 6)  # 5 concordant pairs, 1 discordant
    assert spearman(a, a[::-1]) == pytest.approx(-1.0) and kendall(a, a[::-1]) == -1.0
    r = rank_agreement({"x": {"deletion_auc": 0.1, "insertion_auc": 0.9}, "y": {"deletion_auc": 0.3,
                                                                              "insertion_auc": 0.5},
                        "z": {"deletion_auc": 0.2, "insertion_auc": 0.7}})
    assert r["metrics"] == ["deletion_auc", "insertion_auc"] and r["spearman"][0][1] == pytest.approx(1.0)
