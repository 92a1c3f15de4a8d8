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
# # A Vision Transformer on CIFAR-10, from scratch, on a CPU
#
# The tutorial "Understand and Implement Vision Transformer with TensorFlow 2.0" cuts CIFAR-10's images into
# patches, builds a ViT, trains it with Keras's `model.fit` and draws the learning curves and the confusion matrix.
# This notebook walks the same way with vitlab: the data as the same NumPy arrays, one call to `vitlab.fit` (the
# trainer `vitlab train` runs: augmentation, AdamW, warmup and cosine, a run folder on disk), then the curves, the
# confusion matrix, predictions and where the model looks.
#
# **Budget.** As written it trains a small ViT (`vit_nano_patch4_32`, 0.8M parameters) for 10 minutes on all
# 50,000 training images, on two CPU cores. With `VITLAB_NOTEBOOK_QUICK=1` in the environment (how the test suite
# runs it) it trains for two epochs on 1,000 images, which shows every step but not a good model.

# %%
# %matplotlib inline
import os

from cifar10 import CLASSES, load_cifar10
from IPython.display import display
from matplotlib.figure import Figure

import vitlab

QUICK = os.environ.get("VITLAB_NOTEBOOK_QUICK") == "1"

# %% [markdown]
# ## The data, as Keras gives it
#
# `keras.datasets.cifar10.load_data()` returns uint8 images of shape `(N, 32, 32, 3)` and labels of shape `(N, 1)`.
# `load_cifar10` (in `cifar10.py` beside this notebook) reads the same arrays from the archive of JPEG files;
# `vitlab.fit` takes them as they are.

# %%
(x_train, y_train), (x_test, y_test) = load_cifar10(per_class=100 if QUICK else None,
                                                    test_per_class=20 if QUICK else None)
print("train", x_train.shape, y_train.shape, x_train.dtype, "  test", x_test.shape, y_test.shape)

# %% [markdown]
# ## An image cut into patches
#
# A ViT reads an image as a sequence of square patches, each flattened and projected to one token; a class token
# is put in front and a position embedding added, and the transformer's blocks mix the tokens. With 4x4 patches
# a 32x32 image is a sequence of 8 x 8 = 64 tokens.

# %%
MODEL = "vit_nano_patch4_32"  # 0.8M parameters: quick on a CPU
patch = vitlab.create_model(MODEL, num_classes=10).patch_embed.patch_size[0]
image = x_train[7]
grid = image.shape[0] // patch
print(f"{MODEL}: {patch}x{patch} patches, a sequence of {grid * grid} tokens")

# %% tags=["figure"]
fig = Figure(figsize=(9, 4.5))
whole = fig.add_subplot(1, 2, 1)
whole.imshow(image)
whole.set_title(f"{CLASSES[int(y_train[7, 0])]}, 32x32 pixels")
whole.axis("off")
patches = fig.add_subfigure(fig.add_gridspec(1, 2)[1]).subplots(grid, grid)
for i, ax in enumerate(patches.flat):
    row, col = divmod(i, grid)
    ax.imshow(image[row * patch:(row + 1) * patch, col * patch:(col + 1) * patch])
    ax.axis("off")
display(fig)

# %% [markdown]
# ## Training: `vitlab.fit`
#
# `vitlab.fit(model, data, **options)` takes a registered model name (or a model from `vitlab.create_model`), the
# arrays, and any option of `vitlab train` by its name (`vitlab train --help` lists them): here a time budget,
# over which the learning-rate schedule is laid. It writes a run folder under `runs/` (config, metrics, the
# model, figures), so the run can be resumed, evaluated or inspected from the command line too. An interrupt
# (the stop button) keeps the last finished epoch: `vitlab.fit(resume=RUN)` goes on from it.

# %%
budget = dict(epochs=2) if QUICK else dict(time_budget=10)
result = vitlab.fit(MODEL, ((x_train, y_train), (x_test, y_test)), class_names=CLASSES, **budget)
print(result.out, f"test top-1 {result.summary['top1']:.2%}")

# %% [markdown]
# `result.history` holds one dict per epoch (the run's `metrics.jsonl`), `result.summary` the final figures.

# %%
for row in result.history:
    print({k: round(v, 4) if isinstance(v, float) else v
           for k, v in row.items() if k in ("epoch", "train_loss", "test_loss", "test_top1")})

# %% tags=["figure"]
result.plot()

# %% tags=["figure"]
result.confusion()

# %% [markdown]
# ## Evaluating and predicting
#
# `vitlab.evaluate` scores a model (in memory or a folder) on arrays or any data source; `vitlab.predict` returns
# one row of class probabilities per image, each image prepared by the model's own preprocessing.

# %%
metrics = vitlab.evaluate(result.model, (x_test, y_test))
print(f"top-1 {metrics['top1']:.2%}  top-5 {metrics['top5']:.2%}")
print({name: f"{value:.0%}" for name, value in metrics["per_class"].items()})

# %% tags=["figure"]
probs = vitlab.predict(result.model, x_test[::len(x_test) // 8][:8])
fig = Figure(figsize=(12, 2.2))
for i, ax in enumerate(fig.subplots(1, 8)):
    ax.imshow(x_test[::len(x_test) // 8][i])
    ax.set_title(f"{CLASSES[probs[i].argmax()]}\n{probs[i].max():.0%}", fontsize=9)
    ax.axis("off")
display(fig)

# %% [markdown]
# ## Where it looks: attention rollout
#
# `vitlab.explain` returns the relevance map `vitlab inspect` draws, one value per patch: here attention rollout
# (Abnar and Zuidema 2020), the attention of the class token followed through every block. `vitlab inspect RUN`
# draws these and more (relevance, faithfulness, a sanity check) into one report.

# %% tags=["figure"]
shown = x_test[::len(x_test) // 6][:6]
maps = vitlab.explain(result.model, shown, method="rollout")  # (6, 8, 8): one value per patch
fig = Figure(figsize=(12, 4.4))
axes = fig.subplots(2, 6)
for i in range(6):
    axes[0, i].imshow(shown[i])
    axes[1, i].imshow(shown[i])
    axes[1, i].imshow(maps[i], cmap="inferno", alpha=0.6, extent=(-0.5, 31.5, 31.5, -0.5))
    for ax in axes[:, i]:
        ax.axis("off")
display(fig)

# %% [markdown]
# ## Next
#
# - The same from the command line: `vitlab train --model vit_nano_patch4_32 --time-budget 10 --data
#   ../shared/data/cifar10-jpg.tar.gz --out runs/c10`; `vitlab inspect runs/c10` for the full report.
# - A plain ViT learns slowly from 50,000 images: this one reached 56.9% in 16 minutes on two cores in the
#   position-embedding study (`docs/studies.md`). A hybrid whose tokens come from a small CNN does better: the
#   30-minute recipe (`recipes/cifar10_hybrid_30min.yaml`) reached 84%, the speed run (`docs/cifar10-speedrun.md`)
#   about 90%.
# - `02_finetune_backbone.py` fine-tunes a trained backbone; `03_mae_pretrain_finetune.py` pre-trains one without
#   labels.
