"""Frozen features: extraction and its cache, DINO's weighted k-NN and the linear probe, against hand computations."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import vitlab
from vitlab.data.augment import normalize
from vitlab.probe import extract_features, knn_classify, knn_votes, linear_probe, set_head_from_probe

# ---------------------------------------------------------------------------------------------------------
# k-NN


def test_knn_votes_equal_a_hand_computation():
    train = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1, 1])
    test = torch.tensor([[2.0, 1.0]])
    # cosine similarities of (2, 1) with the three training points
    s0, s1, s2 = 2 / math.sqrt(5), 1 / math.sqrt(5), 3 / math.sqrt(10)
    t = 0.07
    votes = knn_votes(train, labels, test, k=2, temperature=t, num_classes=2)
    # the two nearest are (1, 1) (class 1) and (1, 0) (class 0); (0, 1) is left out
    assert torch.allclose(votes, torch.tensor([[math.exp(s0 / t), math.exp(s2 / t)]]), rtol=1e-5)
    votes = knn_votes(train, labels, test, k=3, temperature=t, num_classes=3)
    assert torch.allclose(votes, torch.tensor([[math.exp(s0 / t), math.exp(s1 / t) + math.exp(s2 / t), 0.0]]),
                          rtol=1e-5)
    assert knn_classify(train, labels, test, k=2, temperature=t).tolist() == [1]


def test_knn_weights_by_similarity_not_majority():
    # two class-0 neighbours at similarity 0.5, one class-1 neighbour at 0.9
    a = math.acos(0.5)
    train = torch.tensor([[math.cos(a), math.sin(a)], [math.cos(a), -math.sin(a)], [0.9, math.sqrt(1 - 0.81)]])
    labels = torch.tensor([0, 0, 1])
    test = torch.tensor([[3.0, 0.0]])  # the length does not matter: features are L2-normalised
    assert knn_classify(train, labels, test, k=3, temperature=0.07).tolist() == [1]  # e^(0.9/.07) > 2 e^(0.5/.07)
    assert knn_classify(train, labels, test, k=3, temperature=100.0).tolist() == [0]  # ~ a plain majority vote
    assert knn_classify(train, labels, test, k=1).tolist() == [1]


def test_knn_caps_k_and_chunks_alike():
    g = torch.Generator().manual_seed(0)
    train, test = torch.randn(40, 8, generator=g), torch.randn(25, 8, generator=g)
    labels = torch.randint(0, 4, (40,), generator=g)
    whole = knn_votes(train, labels, test, k=7)
    assert torch.allclose(knn_votes(train, labels, test, k=7, chunk=4), whole)
    assert torch.allclose(knn_votes(train, labels, test, k=500), knn_votes(train, labels, test, k=40))


@pytest.mark.parametrize("kwargs, message", [
    ({"k": 0}, "k must be a positive int"),
    ({"temperature": 0.0}, "temperature must be positive"),
    ({"num_classes": 2}, r"labels range over 0\.\.2, outside 0\.\.1"),
])
def test_knn_bad_arguments(kwargs, message):
    train, labels = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match=message):
        knn_votes(train, labels, torch.randn(2, 3), **kwargs)
    with pytest.raises(ValueError, match="training features have 3 dimensions, test 4"):
        knn_votes(train, labels, torch.randn(2, 4))


# ---------------------------------------------------------------------------------------------------------
# linear probe


def separable(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [-4.0, -4.0, 0.0]])
    labels = torch.arange(n) % 3
    feats = centres[labels] + torch.randn(n, 3, generator=g) * 0.5
    feats[:, 2] = 10 + 50 * feats[:, 2]  # a feature far off scale: standardisation copes
    return feats, labels


def newton(z, y, c, wd, steps=30):
    """Multinomial logistic regression by Newton's method on (W, b), an independent solver."""
    d = z.shape[1]

    def f(theta):
        w, b = theta[:c * d].view(c, d), theta[c * d:]
        return F.cross_entropy(z @ w.T + b, y) + 0.5 * wd * (w * w).sum()

    theta = torch.zeros(c * d + c, dtype=torch.float64)
    for _ in range(steps):
        g = torch.autograd.functional.jacobian(f, theta)
        h = torch.autograd.functional.hessian(f, theta) + 1e-12 * torch.eye(len(theta), dtype=torch.float64)
        theta = theta - torch.linalg.lstsq(h, g).solution  # b is determined up to a shift: lstsq picks one
    return theta[:c * d].view(c, d), theta[c * d:], float(f(theta))


def test_linear_probe_separates_toy_data_and_matches_newton():
    feats, labels = separable()
    test_feats, test_labels = separable(seed=1)
    probe = linear_probe(feats, labels, test_feats, test_labels, weight_decay=1e-2, epochs=500)
    assert probe.train_accuracy == 1.0 and probe.test_accuracy == 1.0
    x = feats.double()
    mu, sd = x.mean(0), x.std(0, unbiased=False)
    w, b, loss = newton((x - mu) / sd, labels, 3, 1e-2)
    assert probe.loss == pytest.approx(loss, rel=1e-6)
    # the same classifier on raw features: equal probabilities, and W equal (b only up to a common shift)
    ours = probe.linear(feats).double().softmax(1)
    theirs = (((x - mu) / sd) @ w.T + b).softmax(1)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(probe.linear.weight.double(), w / sd, rtol=1e-4, atol=1e-6)


def test_linear_probe_is_deterministic_and_validates():
    feats, labels = separable()
    threads = torch.get_num_threads()
    a, b = linear_probe(feats, labels), linear_probe(feats, labels)
    assert torch.equal(a.linear.weight, b.linear.weight) and a.test_accuracy is None
    assert torch.get_num_threads() == threads  # a small probe runs on one thread and gives the count back
    with pytest.raises(ValueError, match="give both test_feats and test_labels"):
        linear_probe(feats, labels, feats)
    with pytest.raises(ValueError, match="training labels must be"):
        linear_probe(feats, labels[:-1])
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        linear_probe(feats, labels, weight_decay=-1.0)


def test_stronger_weight_decay_shrinks_the_weights():
    feats, labels = separable()
    weak, strong = linear_probe(feats, labels, weight_decay=1e-3), linear_probe(feats, labels, weight_decay=1.0)
    assert strong.linear.weight.norm() < weak.linear.weight.norm() / 3


# ---------------------------------------------------------------------------------------------------------
# feature extraction and its cache


class Counter:
    def __init__(self, model):
        self.images = 0
        inner = model.forward_features

        def counted(x):
            self.images += len(x)
            return inner(x)
        model.forward_features = counted


@pytest.fixture
def images():
    return torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["vit_nano_patch4_32", "deit_nano_distilled_patch4_32", "resnet10_32"])
def test_features_are_the_pre_logits(name, images):
    model = vitlab.create_model(name, num_classes=5).train()
    feats = extract_features(model, images, batch_size=4, progress=False)
    assert model.training  # the mode comes back
    model.eval()
    with torch.no_grad():
        x = normalize(images, model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        expected = model.forward_head(model.forward_features(x), pre_logits=True)
    assert feats.shape == (10, model.num_features) and feats.dtype == torch.float32
    assert torch.allclose(feats, expected, atol=1e-5)


def test_features_resize_to_the_model_size_and_read_a_store_array(images):
    model = vitlab.create_model("vit_nano_patch4_32", num_classes=5)
    big = torch.nn.functional.interpolate(images.float(), size=(48, 48), mode="nearest").to(torch.uint8)
    from_store = extract_features(model, big.numpy(), batch_size=3, progress=False)  # a mapped store's rows
    assert from_store.shape == (10, model.num_features)
    with torch.no_grad():
        from vitlab.data.views import eval_view
        x = normalize(eval_view(big, (32, 32), 1.0), model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        expected = model.eval().forward_head(model.forward_features(x), pre_logits=True)
    assert torch.allclose(from_store, expected, atol=1e-5)


def test_feature_cache_is_reused_and_invalidated(images, tmp_path):
    model = vitlab.create_model("vit_nano_patch4_32", num_classes=5)
    count = Counter(model)
    first = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
    assert count.images == 10
    files = list(tmp_path.glob("features-*.safetensors"))
    assert len(files) == 1 and torch.equal(load_file(files[0])["features"], first)
    again = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
    assert count.images == 10 and torch.equal(again, first)  # read back, nothing computed
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.add_(0.1)  # changed weights: computed afresh, into another file
    changed = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
    assert count.images == 20 and not torch.allclose(changed, first)
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 2
    other = images.clone()
    other[0, 0, 0, 0] ^= 1  # one pixel of other images
    extract_features(model, other, 4, progress=False, cache_dir=tmp_path)
    assert count.images == 30
    extract_features(model, images, 4, progress=False, cache_dir=tmp_path, mean=(0.5, 0.5, 0.5))
    assert count.images == 40  # other preprocessing
    extract_features(model, images, 4, progress=False, cache_dir=tmp_path, data_id="store-abc")
    extract_features(model, images, 4, progress=False, cache_dir=tmp_path, data_id="store-abc")
    assert count.images == 50  # a caller's data id stands for the images' hash


def test_features_read_back_give_the_probe_of_computed_ones(images, tmp_path):
    """Read features sit in memory aligned as computed ones (torch's 64 bytes): CPU kernels round differently on
    unaligned rows, which flipped a probe's borderline test image between a study's first run and its re-run."""
    model = vitlab.create_model("vit_nano_patch4_32", num_classes=5)
    first = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
    for _ in range(3):  # a few reads: wherever the file's bytes land
        again = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
        assert torch.equal(again, first) and again.data_ptr() % 64 == first.data_ptr() % 64 == 0


def test_damaged_cache_is_recomputed(images, tmp_path):
    model = vitlab.create_model("vit_nano_patch4_32", num_classes=5)
    first = extract_features(model, images, 4, progress=False, cache_dir=tmp_path)
    (path,) = tmp_path.glob("features-*.safetensors")
    path.write_bytes(b"not a safetensors file")
    messages = []
    again = extract_features(model, images, 4, progress=False, cache_dir=tmp_path, log=messages.append)
    assert torch.equal(again, first) and "unreadable" in messages[0]
    assert torch.equal(load_file(path)["features"], first)  # written again


def test_progress_bar_and_bad_input(images, capsys):
    model = vitlab.create_model("vit_nano_patch4_32", num_classes=5)
    extract_features(model, images, 4, progress=True)
    assert "10/10" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"expected uint8 images of shape \(N, C, H, W\), got torch.float32"):
        extract_features(model, images.float(), progress=False)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        extract_features(model, images, 0, progress=False)
    with pytest.raises(ValueError, match="precision 'fp16' is not one of fp32, bf16"):
        extract_features(model, np.asarray(images), precision="fp16", progress=False)


@pytest.mark.parametrize("name", ["vit_nano_patch4_32", "deit_nano_distilled_patch4_32", "resnet10_32"])
def test_probe_as_the_models_head_predicts_as_the_probe(name, images):
    model = vitlab.create_model(name, num_classes=5)
    feats = extract_features(model, images, 5, progress=False)
    probe = linear_probe(feats, torch.arange(10) % 3, epochs=20)
    assert set_head_from_probe(model, probe) == (["head", "head_dist"] if "distilled" in name else
                                                 ["fc"] if "resnet" in name else ["head"])
    assert model.num_classes == 3
    with torch.no_grad():
        x = normalize(images, model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        logits = model.eval()(x)
    assert torch.allclose(logits, probe.linear(feats), atol=1e-4)
    assert torch.equal(logits.argmax(1), probe.predict(feats))


# ---------------------------------------------------------------------------------------------------------
# vitlab probe, end to end

def _run(tmp_path_factory):
    from vitlab.train import load_recipe, train
    out = tmp_path_factory.mktemp("probe") / "run"
    train(load_recipe(None, model="vit_micro_patch2_8", epochs=1, precision="fp32", threads=1, out=str(out),
                      cache_dir=str(out.parent / "cache")), log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    return _run(tmp_path_factory)


def test_probe_command_on_a_digits_run_equals_a_hand_computation(digits_run, tmp_path, capsys):
    import json

    from vitlab.cli import main
    from vitlab.data.sources import load_data
    from vitlab.probe.classifiers import accuracy

    cache = digits_run.parent / "cache"
    args = ["probe", str(digits_run), "--threads", "1", "--cache-dir", str(cache)]
    assert main([*args, "--out", str(tmp_path / "p")]) == 0
    captured = capsys.readouterr()
    result = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert result["data"] == "digits" and result["split"] == {"seed": 0, "val_fraction": 0.2, "train_fraction": 1.0}
    assert (result["num_train"], result["num_test"], result["features"]) == (1437, 360, 64)
    assert "features of 1437 images cached in" in captured.err
    lines = captured.out.splitlines()
    assert lines[1].split() == ["classifier", "test", "top-1", "seconds"]
    assert f"{100 * result['knn']['top1']:.2f}%" in lines[2] and f"{100 * result['linear']['top1']:.2f}%" in lines[3]
    # by hand: the run's model, the run's split, its own normalisation
    model = vitlab.load(digits_run)
    data = load_data("digits", cache_dir=cache, log=lambda s: None)
    cfg = model.pretrained_cfg
    feats = {name: extract_features(model, split.images, progress=False, mean=cfg["mean"], std=cfg["std"])
             for name, split in (("train", data.train), ("test", data.test))}
    knn = knn_classify(feats["train"], data.train.labels, feats["test"], k=20, temperature=0.07, num_classes=10)
    assert result["knn"]["top1"] == accuracy(knn, data.test.labels)
    probe = linear_probe(feats["train"], data.train.labels, feats["test"], data.test.labels, num_classes=10)
    assert result["linear"]["top1"] == pytest.approx(probe.test_accuracy, abs=1 / 360)
    # a second probe reads the features back
    assert main(args) == 0
    assert "features of 1437 images read from" in capsys.readouterr().err


def test_probe_command_on_a_tiny_folder_with_a_random_model(tmp_path, capsys):
    import json

    from PIL import Image

    from vitlab.cli import main
    rng = np.random.default_rng(0)
    for c in range(3):  # three classes told apart by their brightness
        (tmp_path / "set" / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = np.clip(rng.normal(60 + 70 * c, 10, (12, 12, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "set" / f"c{c}" / f"{i}.png")
    code = main(["probe", "vit_micro_patch2_8", "--data", str(tmp_path / "set"), "--train-fraction", "0.5",
                 "--seed", "3", "--k", "3", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "p")])
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert result["weights"] == "random weights" and result["classes"] == ["c0", "c1", "c2"]
    assert result["num_train"] == 12 and result["num_test"] == 6  # 8 training images a class, half of them
    assert result["split"] == {"seed": 3, "val_fraction": 0.2, "train_fraction": 0.5} and result["knn"]["k"] == 3
    assert result["linear"]["top1"] == 1.0  # brightness survives random features


@pytest.mark.parametrize("args, message", [
    (["no_such_model", "--data", "digits"], "no_such_model is neither a model folder, a hub id"),
    (["MODEL"], "is not a run folder (no config.yaml names its data): give --data"),
    (["RUN", "--precision", "fp16"], "--precision fp16 is not valid for features; accepted: fp32, bf16, auto"),
    (["RUN", "--probe-wd", "-1"], "--probe-wd -1 is not valid; accepted: a number >= 0"),
    (["RUN", "--k", "0"], "argument --k: '0' is not valid; accepted: an integer >= 1"),
    (["RUN", "--out", "FOREIGN"], "holds files that vitlab probe did not write (notes.txt)"),
])
def test_probe_command_bad_input_is_one_line(args, message, digits_run, tmp_path, capsys):
    from vitlab.cli import main
    model = tmp_path / "model"
    vitlab.save(vitlab.create_model("vit_micro_patch2_8", num_classes=10), model)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    swap = {"MODEL": str(model), "RUN": str(digits_run), "FOREIGN": str(tmp_path / "foreign")}
    try:
        code = main(["probe", *[swap.get(a, a) for a in args], "--cache-dir", str(digits_run.parent / "cache")])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err), err
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine" and not (tmp_path / "foreign" / "probe.json"
                                                                              ).exists()
