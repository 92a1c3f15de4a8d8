"""What a notebook user coming from Keras does works: one-hot labels, float images in [0, 1] or [0, 255], (N, H, W)
images, ``validation_split``, ``fit`` on a module training that module, ``history_dict``, and a ``help(vitlab.fit)``
that lists every option with its default; input that cannot be read is still one line naming what is accepted."""
from __future__ import annotations

import inspect
from importlib.resources import files

import numpy as np
import pytest
import torch

import vitlab
from vitlab.data.arrays import hold_out_last, split_arrays, store_arrays
from vitlab.errors import VitlabError
from vitlab.runs.format import read_config
from vitlab.train.recipe import AUGMENT_FIELDS, FIELDS, SUPERVISED_ONLY

QUICK = dict(epochs=1, threads=1, precision="fp32", batch_size=32)


def digits(n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` embedded digits as Keras's MNIST gives its arrays: uint8 (N, 8, 8) in 0..255, labels (N,)."""
    with np.load(files("vitlab.data") / "digits.npz") as z:
        x, y = z["images"][:n].astype(np.int64), z["labels"][:n]
    return (x * 255 // 16).astype(np.uint8), y.astype(np.int64)


def said(data) -> tuple[tuple, tuple | None, list[str]]:
    lines: list[str] = []
    train, test = split_arrays(data, lines.append)
    return train, test, lines


def test_one_hot_labels_and_float_images_read_as_the_uint8_and_classes_they_are():
    x, y = digits()
    (xu, yu), _, quiet = said((x, y))
    assert xu.shape == (240, 1, 8, 8) and xu.dtype == np.uint8 and np.array_equal(yu, y)
    assert quiet == ["data images of shape (240, 8, 8): read as one channel, (N, H, W, 1)"]
    one_hot = np.eye(10, dtype=np.float32)[y]                     # keras.utils.to_categorical's
    for images, word in [(x / 255.0, "[0, 1]"), (x.astype(np.float32), "[0, 255]"), (x.astype(np.int64), "0..255")]:
        (xi, yi), _, lines = said((images[..., None], one_hot))
        assert np.array_equal(xi, xu) and np.array_equal(yi, y)
        assert any(word in line for line in lines) and any("one-hot rows (240, 10)" in line for line in lines)
    (_, yi), _, _ = said((x, one_hot.astype(np.uint8)))              # integer one-hot too
    assert np.array_equal(yi, y)
    (_, yi), _, _ = said((x, y.astype(np.float64)))                  # whole floats are indices
    assert np.array_equal(yi, y) and yi.dtype == np.int64


def test_float_arrays_find_the_store_of_their_uint8_arrays(tmp_path):
    x, y = digits(60)
    (x_test, y_test) = digits(90)[0][60:], digits(90)[1][60:]
    store = store_arrays(((x, y), (x_test, y_test)), cache_dir=tmp_path, log=lambda line: None)
    again = store_arrays(((x / 255.0, np.eye(10)[y]), (x_test.astype(np.float32), y_test[:, None])),
                         cache_dir=tmp_path, log=lambda line: None)
    assert again == store and len(list(tmp_path.glob("arrays-*"))) == 1


@pytest.mark.parametrize("images, labels, message", [
    (np.linspace(0, 300, 256).reshape(4, 8, 8), np.zeros(4, int), "0..300, outside [0, 1] and [0, 255] (they exceed"),
    (np.linspace(-1, 1, 256).reshape(4, 8, 8), np.zeros(4, int), "scaled to [-1, 1]: give (x + 1) / 2"),
    (np.linspace(-2, 3, 256).reshape(4, 8, 8), np.zeros(4, int), "normalised (mean and std)"),
    (np.full((4, 8, 8), np.nan, np.float32), np.zeros(4, int), "NaN or infinite"),
    (np.full((4, 8, 8), 256, np.int32), np.zeros(4, int), "int32 hold values 256..256"),
    (np.zeros((4, 8, 8), bool), np.zeros(4, int), "dtype bool are not valid; accepted: uint8, or floats in [0, 1]"),
    (np.zeros((4, 8, 8, 2), np.uint8), np.zeros(4, int), "shape (4, 8, 8, 2) are not valid; accepted: (N, H, W, C)"),
    (np.zeros((4, 8), np.uint8), np.zeros(4, int), "shape (4, 8) are not valid"),
    ([np.zeros((8, 8), np.uint8), np.zeros((9, 8), np.uint8)], np.zeros(2, int), "the sizes differ"),
    (np.zeros((4, 8, 8), np.uint8), np.full((4, 3), 1 / 3), "soft targets (probabilities)"),
    (np.zeros((4, 8, 8), np.uint8), np.zeros((4, 2), int), "neither class indices nor one-hot (row 0: 0, 0)"),
    (np.zeros((4, 8, 8), np.uint8), np.array([0.5, 1, 2, 3]), "float64 and shape (4,) are not valid"),
    (np.zeros((4, 8, 8), np.uint8), np.zeros((4, 2, 2), int), "shape (4, 2, 2) are not valid"),
    (np.zeros((4, 8, 8), np.uint8), [[0], [1, 2], [3], [4]], "the sizes differ"),
])
def test_arrays_that_cannot_be_read_are_one_line_naming_what_is_accepted(tmp_path, images, labels, message):
    with pytest.raises(VitlabError) as e:
        vitlab.fit("vit_micro_patch2_8", (images, labels), out=tmp_path / "run", cache_dir=str(tmp_path / "cache"))
    text = str(e.value)
    assert message in text and "\n" not in text and "accepted" in text
    assert "astype('uint8')" not in text  # never advice that ruins data already in 0..255
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_validation_split_holds_out_the_last_share_as_keras_does(tmp_path):
    x, y = digits(100)
    (xt, yt), (xv, yv) = hold_out_last((x, y), 0.25)
    assert np.array_equal(xt, x[:75]) and np.array_equal(xv, x[75:]) and np.array_equal(yv, y[75:])
    (xt, _), (xv, _) = hold_out_last((x, y), 0.1)  # floor(100 * 0.9) = 90 train, as Keras's split_at
    assert len(xt) == 90 and len(xv) == 10
    for data, value, message in [(((x, y), (x, y)), 0.2, "not ((x_train, y_train), (x_test, y_test))"),
                                 ("digits", 0.2, "its share: val_fraction"), ((x, y), 0.0, "a number in (0, 1)"),
                                 ((x, y), 1.0, "a number in (0, 1)"), ((x, y), "0.2", "a number in (0, 1)"),
                                 ((x[:1], y[:1]), 0.5, "leaves no images to train on"),
                                 ((x, y[:9]), 0.5, "labels number 9, the images 100")]:
        with pytest.raises(VitlabError, match=None) as e:
            vitlab.fit("vit_micro_patch2_8", data, validation_split=value, out=tmp_path / "run")
        assert message in str(e.value) and "\n" not in str(e.value)
    for data, extra, message in [(((x, y), (x, y)), {}, "not ((x_train, y_train), (x_test, y_test))"),
                                 ("digits", {}, "nor a source"), ((x, y), {"validation_split": 0.1}, "one of them")]:
        with pytest.raises(VitlabError) as e:
            vitlab.fit("vit_micro_patch2_8", data, validation_data=(x[:4], y[:4]), out=tmp_path / "run", **extra)
        assert message in str(e.value)
    with pytest.raises(VitlabError, match="accepted with resume"):
        vitlab.fit(resume=tmp_path, validation_split=0.2)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def two_fits(tmp_path_factory):
    """A module fitted twice on float images in [0, 1] and one-hot labels with validation_split: (module, the first
    result, the module's weights after the first fit, the second result)."""
    tmp = tmp_path_factory.mktemp("keras")
    threads = torch.get_num_threads()
    x, y = digits(200)
    data = (x / 255.0, np.eye(10)[y])
    module = vitlab.create_model("vit_micro_patch2_8", in_chans=1, img_size=8, num_classes=10)
    first = vitlab.fit(module, data, validation_split=0.2, out=tmp / "first", cache_dir=str(tmp / "cache"),
                       **{**QUICK, "epochs": 2})
    after_first = {k: v.clone() for k, v in module.state_dict().items()}
    second = vitlab.fit(module, data, validation_split=0.2, out=tmp / "second", cache_dir=str(tmp / "cache"), **QUICK)
    torch.set_num_threads(threads)
    return module, first, after_first, second


def test_fit_trains_the_module_it_is_given_and_a_second_fit_goes_on_from_there(two_fits):
    module, first, after_first, second = two_fits
    assert first.model is module and second.model is module and not module.training
    assert first.summary["num_test"] == 40 and first.summary["num_train"] == 160  # the last 20% held out
    start = vitlab.load(read_config(second.out)["init"])
    for name, tensor in start.state_dict().items():
        assert torch.equal(tensor, after_first[name]), name   # the second fit started where the first ended
    saved = vitlab.load(second.out).state_dict()
    assert any(not torch.equal(after_first[k], v) for k, v in module.state_dict().items())  # it trained on
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, saved[name]), name             # the module is the run's trained model
    ones = np.eye(10)[digits(200)[1][160:]]
    metrics = vitlab.evaluate(module, (digits(200)[0][160:] / 255.0, ones))
    assert metrics["top1"] == pytest.approx(second.summary["top1"]) and metrics["count"] == 40


def test_the_history_is_also_a_dict_of_lists_as_keras_history(two_fits):
    _, first, _, _ = two_fits
    h = first.history_dict
    assert h["loss"] == h["train_loss"] == [row["train_loss"] for row in first.history]
    assert h["val_accuracy"] == h["test_top1"] == [row["test_top1"] for row in first.history]
    assert h["accuracy"] == h["train_acc"] and h["val_loss"] == h["test_loss"]
    assert h["epoch"] == [1, 2] and all(len(v) == 2 for v in h.values())


def test_validation_data_is_the_test_split_as_keras_takes_it(tmp_path, one_thread):
    x, y = digits(120)
    result = vitlab.fit("vit_micro_patch2_8", (x[:100], y[:100]), validation_data=(x[100:], y[100:]),
                        out=tmp_path / "run", cache_dir=str(tmp_path / "cache"), **QUICK)
    assert result.summary["num_train"] == 100 and result.summary["num_test"] == 20
    assert vitlab.evaluate(result.model, (x[100:], y[100:]))["top1"] == pytest.approx(result.summary["top1"])


def test_help_and_completion_list_every_option_with_its_default():
    fit = inspect.signature(vitlab.fit).parameters
    for name in [*FIELDS, *AUGMENT_FIELDS]:
        assert name in fit or name == "auto", name  # auto: the record of the automatic choice, not an option
    assert list(fit)[:2] == ["model", "data"] and fit["validation_split"].default is None
    assert fit["epochs"].default == FIELDS["epochs"].default == 30
    assert fit["epochs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert fit["mixup"].default == AUGMENT_FIELDS["mixup"].default and fit["batch_size"].default == 128
    doc = vitlab.fit.__doc__
    for name in [*FIELDS, *AUGMENT_FIELDS]:
        if name not in ("data", "out", "augment", "auto"):
            assert f"\n        {name}: " in doc, name
    assert "epochs: epochs to train (default 30; per data set (digits: 50))" in doc
    pre = inspect.signature(vitlab.pretrain).parameters
    assert "method" in pre and "epochs" in pre and "pretrain" not in pre
    assert not {n for n in SUPERVISED_ONLY if n != "teacher"} & set(pre)
    assert pre["drop_path"].default == 0.0 and pre["min_lr"].default == 0.0  # pre-training's own defaults


def test_options_by_name_still_reach_the_recipe_and_unknown_ones_are_refused(tmp_path):
    with pytest.raises(VitlabError, match=r"unknown option\(s\) epoch; accepted: model, init, "):
        vitlab.fit("vit_micro_patch2_8", "digits", out=tmp_path / "run", epoch=3)
    with pytest.raises(VitlabError, match="epochs=0|epochs"):
        vitlab.fit("vit_micro_patch2_8", "digits", out=tmp_path / "run", epochs=0)
    assert not (tmp_path / "run").exists()


def test_predict_reads_float_images_by_the_batch_range():
    from vitlab.infer.predict import decode_images
    model = vitlab.create_model("vit_micro_patch2_8", in_chans=1, img_size=8, num_classes=10)
    x, _ = digits(16)
    x[0] = x[0] > 200  # a near-black image of 0s and 1s: alone it reads as [0, 1]; in its batch, as [0, 255]
    as_uint8 = decode_images(x[..., None], model.pretrained_cfg)
    assert torch.equal(decode_images(x[..., None] / 255.0, model.pretrained_cfg), as_uint8)
    assert torch.equal(decode_images(x[..., None].astype(np.float32), model.pretrained_cfg), as_uint8)
    probs = vitlab.predict(model, x[..., None] / 255.0)
    assert probs.shape == (16, 10) and np.allclose(probs, vitlab.predict(model, x[..., None]), atol=1e-6)
    with pytest.raises(VitlabError, match="outside"):
        vitlab.predict(model, x[..., None] * 4.0)


def test_a_module_whose_head_the_run_replaces_is_that_run_s_model_after(tmp_path, one_thread):
    x, y = digits(100)
    module = vitlab.create_model("vit_micro_patch2_8", in_chans=1, img_size=8, num_classes=4)
    head = module.get_classifier()
    result = vitlab.fit(module, (x, y), validation_split=0.2, out=tmp_path / "run", cache_dir=str(tmp_path / "c"),
                        **QUICK)
    assert result.model is module and module.num_classes == 10 and module.get_classifier() is not head
    saved = vitlab.load(result.out).state_dict()
    assert module.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())
    assert vitlab.predict(module, x[80:]).shape == (20, 10)  # (N, H, W): one channel each, as Keras's MNIST
    assert vitlab.explain(module, x[80:83]).shape == (3, 4, 4) and vitlab.explain(module, x[80]).shape == (4, 4)
