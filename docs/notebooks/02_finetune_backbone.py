# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fine-tuning a backbone with layer decay, then evaluating, predicting and exporting to ONNX
#
# With few labels, start from a backbone that has already learnt to see. Any folder `vitlab.load` reads is one:
# a vitlab run, a timm or Hugging Face folder, or an `hf-hub:` id such as
# `hf-hub:timm/deit3_small_patch16_224.fb_in22k_ft_in1k` (`pip install 'vitlab[hub]'`). Set `BACKBONE` in the
# environment to fine-tune yours. Without it, this notebook makes one that needs no download: a ViT trained on five
# CIFAR-10 classes (airplane, automobile, bird, cat, deer), which it then moves to the other five (dog, frog,
# horse, ship, truck) with a tenth of their labels. `docs/finetune.md` measures this transfer against training from
# scratch and against probes of the frozen features.
#
# **Budget.** As written: 5 minutes for the backbone and 3 for the fine-tune on two CPU cores. With
# `VITLAB_NOTEBOOK_QUICK=1` (how the test suite runs it): a few epochs on a few hundred images.

# %%
# %matplotlib inline
import json
import os
from pathlib import Path

import numpy as np
from cifar10 import CLASSES, load_cifar10
from IPython.display import display
from matplotlib.figure import Figure

import vitlab
from vitlab.export import export

QUICK = os.environ.get("VITLAB_NOTEBOOK_QUICK") == "1"
MODEL = "vit_nano_patch4_32"  # 0.8M parameters: quick on a CPU

(x_train, y_train), (x_test, y_test) = load_cifar10(per_class=100 if QUICK else None,
                                                    test_per_class=20 if QUICK else None)


def classes(x, y, first, last):
    """The images of classes first..last-1, their labels renumbered from 0."""
    keep = (y[:, 0] >= first) & (y[:, 0] < last)
    return x[keep], y[keep] - first


# %% [markdown]
# ## The backbone folder
#
# A run folder holds the model as `config.json` + `model.safetensors`, with the preprocessing it was trained with;
# that is all `--init` (and `vitlab.fit(FOLDER, ...)`) needs.

# %%
BACKBONE = os.environ.get("BACKBONE")
if BACKBONE is None:
    source = (classes(x_train, y_train, 0, 5), classes(x_test, y_test, 0, 5))
    backbone = vitlab.fit(MODEL, source, class_names=CLASSES[:5], **(dict(epochs=3) if QUICK else dict(time_budget=5)))
    BACKBONE = backbone.out
    print(f"backbone: {BACKBONE}, test top-1 {backbone.summary['top1']:.2%} on its five classes")

# %% [markdown]
# ## Fine-tuning with layer-wise learning-rate decay
#
# `layer_decay=0.75` (BEiT, MAE and DeiT III use 0.65-0.75) keeps the early blocks near what they learnt: the head
# learns at the full rate, block i of N at `lr x 0.75^(N + 1 - i)`, the patch embedding at `lr x 0.75^(N + 1)`.
# The backbone predicts other classes, so its head is replaced by a new one that starts at zero (`head_init`
# `auto`). The log names the parameter groups.

# %%
(x_few, y_few), (x_eval, y_eval) = classes(x_train, y_train, 5, 10), classes(x_test, y_test, 5, 10)
x_few, y_few = x_few[::10], y_few[::10]  # a tenth of the labels
print(f"fine-tuning on {len(x_few)} labelled images, evaluating on {len(x_eval)}")
tuned = vitlab.fit(BACKBONE, ((x_few, y_few), (x_eval, y_eval)), class_names=CLASSES[5:], layer_decay=0.75,
                   **(dict(epochs=3) if QUICK else dict(time_budget=3)))

# %% tags=["figure"]
tuned.plot()

# %% tags=["figure"]
tuned.confusion()

# %% [markdown]
# ## Evaluating and predicting
#
# Both take the model in memory or its folder; images are prepared by the model's own preprocessing (the one the
# folder records), as `vitlab eval` and `vitlab predict` do.

# %%
metrics = vitlab.evaluate(tuned.out, (x_eval, y_eval))
print(f"top-1 {metrics['top1']:.2%}", {name: f"{value:.0%}" for name, value in metrics["per_class"].items()})

# %% tags=["figure"]
shown = x_eval[::len(x_eval) // 6][:6]
probs = vitlab.predict(tuned.model, shown)
fig = Figure(figsize=(10, 2.2))
for i, ax in enumerate(fig.subplots(1, 6)):
    ax.imshow(shown[i])
    ax.set_title(f"{CLASSES[5 + probs[i].argmax()]} {probs[i].max():.0%}", fontsize=9)
    ax.axis("off")
display(fig)

# %% [markdown]
# ## Exporting to ONNX
#
# `export(model, "onnx", folder)` writes `model.onnx` (input `images`, (B, C, H, W) floats; output `logits`) and
# `preprocess.json`, the preprocessing in timm's keys. onnxruntime (`pip install 'vitlab[onnx]'`) then runs the
# model without PyTorch; its probabilities match `vitlab.predict`'s.

# %%
onnx_file = export(tuned.model, "onnx", Path(f"{tuned.out}-onnx"))
pre = json.loads((onnx_file.parent / "preprocess.json").read_text())
print(onnx_file, {k: pre[k] for k in ("input_size", "mean", "std", "resize")})

# %%
import onnxruntime  # noqa: E402

session = onnxruntime.InferenceSession(str(onnx_file))
mean, std = np.array(pre["mean"], np.float32), np.array(pre["std"], np.float32)
images = ((shown.astype(np.float32) / 255 - mean) / std).transpose(0, 3, 1, 2)  # 32x32 already: no resize
logits = session.run(["logits"], {"images": images})[0]
onnx_probs = np.exp(logits - logits.max(1, keepdims=True))
onnx_probs /= onnx_probs.sum(1, keepdims=True)
print(f"largest difference from vitlab.predict: {np.abs(onnx_probs - probs).max():.1e}")
assert np.allclose(onnx_probs, probs, atol=1e-4)
