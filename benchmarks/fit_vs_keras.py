"""The seed tutorial beside ``vitlab.fit``: CIFAR-10 arrays, the same minutes, the same threads, side by side.

The seed tutorial is keras.io's "Image classification with Vision Transformer" (Khalid Salama), written here in
Keras 3 on the torch backend as it stands there: a data augmentation block (normalisation adapted to the training
images, resizing to 72x72, horizontal flips, rotation 0.02, zoom 0.2), 6x6 patches with a dense projection and a
learned position embedding (projection_dim 64), 8 transformer layers (pre-norm, MultiHeadAttention of 4 heads with
key_dim 64 and dropout 0.1, an MLP of [128, 64] GELU units), a flattened representation with dropout 0.5, an MLP
head of [2048, 1024] units and a dense layer of logits; AdamW at lr 1e-3 and weight decay 1e-4, sparse categorical
cross-entropy from logits, batch 256. Its epochs are cut to the budget: training stops when the arm's training
clock reaches ``--minutes``. The tutorial's own ``validation_split=0.1`` is left out (every image trains): the test
set is what both arms are scored on.

``vitlab.fit`` gets only the data and the budget, ``vitlab.fit(data=((x, y), (x_test, y_test)),
time_budget=MINUTES, threads=1)``: vitlab chooses the rest (``model="auto"``; where this vitlab has no automatic
choice yet, the model a call without one would train, ``--vitlab-model``, is named and said).

Both arms get the same uint8 arrays (decoded once from the JPEG archive with Pillow and cached as .npy files in
``--cache``), one thread each (``--threads``), and run at the same time in two processes, so that they share the
machine alike. They are scored alike on the whole test split at the end, and on the way:

- keras: every ``--minutes / --points`` minutes of training, on the first ``--curve-images`` test images (a sample
  taken the same way for every point). Its evaluations stop its training clock: the tutorial's model predicts about
  three times as fast as it trains, so 10,000 test images take it longer than a 10-minute budget; counting them
  would leave it no training. This favours the tutorial: its training minutes are all its budget, and its last
  ones may run alone on the machine once vitlab has finished.
- vitlab: its own evaluations, as ``vitlab.fit`` makes them (``result.history``), at their minutes on the run's
  clock; its budget is the call's wall time, its evaluations included.

Prints the two curves (test top-1 against minutes) as one table, the final figures (top-1 on the whole test split,
images trained and images a second, wall time), with the CPU named and the load average at the start and the end,
and draws them into ``OUT/fit_vs_keras.png`` (``OUT/results.json`` holds the numbers).

    pip install 'vitlab[bench]'   # keras
    python benchmarks/fit_vs_keras.py --minutes 10 --out runs/fit-vs-keras
    python benchmarks/fit_vs_keras.py --minutes 0.5 --train-images 500 --test-images 200 --out /tmp/fvk  # quick check

The CIFAR-10 archive (train/<class>/*.jpg, test/<class>/*.jpg) is ``--archive``, by default
$VITLAB_SHARED/data/cifar10-jpg.tar.gz (VITLAB_SHARED: the folder beside this checkout named shared).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VITLAB_SHARED", ROOT.parent / "shared"))
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# the seed tutorial's hyperparameters, as keras.io gives them
TUTORIAL = dict(learning_rate=1e-3, weight_decay=1e-4, batch_size=256, image_size=72, patch_size=6, projection_dim=64,
                num_heads=4, transformer_units=[128, 64], transformer_layers=8, mlp_head_units=[2048, 1024])


# --- data ---


def decode_archive(archive: Path) -> dict[str, np.ndarray]:
    """Every image of the archive as uint8 (N, 32, 32, 3) and its label (N, 1), by split, classes in CIFAR-10's
    order and files by name within a class."""
    from PIL import Image
    found: dict[str, list[tuple[int, str, bytes]]] = {"train": [], "test": []}
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and parts[0] in found and parts[1] in CLASSES:
                found[parts[0]].append((CLASSES.index(parts[1]), parts[2], tar.extractfile(member).read()))
    arrays = {}
    for split, items in found.items():
        items.sort(key=lambda item: item[:2])
        arrays[f"x_{split}"] = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for _, _, b in items])
        arrays[f"y_{split}"] = np.asarray([label for label, _, _ in items], np.uint8).reshape(-1, 1)
    return arrays


def cached_arrays(archive: Path, cache: Path) -> dict[str, np.ndarray]:
    """The archive's arrays, decoded on first use into ``cache`` (named by the archive's size and time)."""
    stat = archive.stat()
    folder = cache / f"cifar10-arrays-{stat.st_size}-{int(stat.st_mtime)}"
    names = ("x_train", "y_train", "x_test", "y_test")
    if not all((folder / f"{n}.npy").is_file() for n in names):
        started = time.perf_counter()
        arrays = decode_archive(archive)
        folder.mkdir(parents=True, exist_ok=True)
        for n in names:
            tmp = folder / f"{n}.tmp.npy"
            np.save(tmp, arrays[n])
            tmp.replace(folder / f"{n}.npy")
        print(f"decoded {archive} into {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return {n: np.load(folder / f"{n}.npy") for n in names}


def per_class(x: np.ndarray, y: np.ndarray, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n // classes`` images of each class (all without ``n``), in the arrays' order."""
    if n is None:
        return x, y
    k = max(1, n // len(CLASSES))
    rows = np.concatenate([np.flatnonzero(y[:, 0] == c)[:k] for c in range(len(CLASSES))])
    return x[rows], y[rows]


# --- the keras arm ---


def keras_model(x_train: np.ndarray, num_classes: int):
    """The seed tutorial's ViT classifier, its normalisation adapted to ``x_train``."""
    import keras
    from keras import layers, ops

    t = TUTORIAL
    num_patches = (t["image_size"] // t["patch_size"]) ** 2

    class Patches(layers.Layer):
        def __init__(self, patch_size):
            super().__init__()
            self.patch_size = patch_size

        def call(self, images):
            shape = ops.shape(images)
            grid_h, grid_w = shape[1] // self.patch_size, shape[2] // self.patch_size
            patches = keras.ops.image.extract_patches(images, size=self.patch_size)
            return ops.reshape(patches, (shape[0], grid_h * grid_w, self.patch_size * self.patch_size * shape[3]))

    class PatchEncoder(layers.Layer):
        def __init__(self, num_patches, projection_dim):
            super().__init__()
            self.num_patches = num_patches
            self.projection = layers.Dense(units=projection_dim)
            self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

        def call(self, patch):
            positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
            return self.projection(patch) + self.position_embedding(positions)

    def mlp(x, hidden_units, dropout_rate):
        for units in hidden_units:
            x = layers.Dense(units, activation=keras.activations.gelu)(x)
            x = layers.Dropout(dropout_rate)(x)
        return x

    augmentation = keras.Sequential([layers.Normalization(), layers.Resizing(t["image_size"], t["image_size"]),
                                     layers.RandomFlip("horizontal"), layers.RandomRotation(factor=0.02),
                                     layers.RandomZoom(height_factor=0.2, width_factor=0.2)], name="data_augmentation")
    augmentation.layers[0].adapt(x_train)
    inputs = keras.Input(shape=x_train.shape[1:])
    encoded = PatchEncoder(num_patches, t["projection_dim"])(Patches(t["patch_size"])(augmentation(inputs)))
    for _ in range(t["transformer_layers"]):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=t["num_heads"], key_dim=t["projection_dim"],
                                              dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = mlp(layers.LayerNormalization(epsilon=1e-6)(x2), hidden_units=t["transformer_units"], dropout_rate=0.1)
        encoded = layers.Add()([x3, x2])
    representation = layers.Dropout(0.5)(layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded)))
    logits = layers.Dense(num_classes)(mlp(representation, hidden_units=t["mlp_head_units"], dropout_rate=0.5))
    model = keras.Model(inputs=inputs, outputs=logits)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=t["learning_rate"], weight_decay=t["weight_decay"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    return model


def keras_top1(model, x: np.ndarray, y: np.ndarray) -> float:
    logits = model.predict(x, batch_size=TUTORIAL["batch_size"], verbose=0)
    return float((np.asarray(logits).argmax(1) == y[:, 0]).mean())


def run_keras(data: dict[str, np.ndarray], minutes: float, points: int, curve_images: int) -> dict:
    """Train the tutorial's model until its training clock reaches ``minutes``, scoring it on a test sample every
    ``minutes / points`` (off the clock) and on the whole test split at the end."""
    import keras

    started = time.perf_counter()
    x, y, x_test, y_test = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    model = keras_model(x, len(CLASSES))
    sample = per_class(x_test, y_test, curve_images)  # every class alike (the arrays are in class order)
    budget, marks = minutes * 60, [minutes * 60 * (i + 1) / points for i in range(points - 1)]
    curve: list[dict] = []

    class Clock(keras.callbacks.Callback):
        """The training clock (evaluations stop it), the images trained, the curve's points, the budget's end."""

        def __init__(self):
            super().__init__()
            self.trained, self.images, self.last = 0.0, 0, None

        def on_train_batch_begin(self, batch, logs=None):
            self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            took = time.perf_counter() - self.last
            self.trained += took
            self.images += min(TUTORIAL["batch_size"], len(y) - batch * TUTORIAL["batch_size"])  # an epoch's last
            if marks and self.trained >= marks[0]:
                marks.pop(0)
                curve.append({"minutes": self.trained / 60, "top1": keras_top1(self.model, *sample),
                              "images": self.images, "on": f"{len(sample[1])} test images"})
            if self.trained + took / 2 >= budget:  # the batch that ends nearest the budget is the last
                self.model.stop_training = True

    clock = Clock()
    epochs = 10 ** 6  # cut by the budget
    model.fit(x, y, batch_size=TUTORIAL["batch_size"], epochs=epochs, shuffle=True, verbose=0, callbacks=[clock])
    images = clock.images
    evaluating = time.perf_counter()
    top1 = keras_top1(model, x_test, y_test)
    curve.append({"minutes": clock.trained / 60, "top1": top1, "images": images, "on": f"{len(y_test)} test images"})
    return {"arm": "keras", "what": "the seed tutorial (Keras 3, torch backend)", "curve": curve, "top1": top1,
            "images": images, "train_seconds": clock.trained, "images_per_second": images / max(clock.trained, 1e-9),
            "eval_seconds": time.perf_counter() - evaluating, "wall_seconds": time.perf_counter() - started,
            "keras": keras.__version__}


# --- the vitlab arm ---


def run_vitlab(data: dict[str, np.ndarray], minutes: float, threads: int, out: Path, cache: Path,
               fallback: str) -> dict:
    """``vitlab.fit`` given only the data and the budget (a model named only where it cannot choose one)."""
    import vitlab
    from vitlab.errors import VitlabError

    started = time.perf_counter()
    arrays = ((data["x_train"], data["y_train"]), (data["x_test"], data["y_test"]))
    options = dict(time_budget=minutes, threads=threads, out=out, cache_dir=str(cache))
    try:
        result, chose = vitlab.fit(data=arrays, **options), "auto"
    except VitlabError as e:
        if "needs a model" not in str(e):
            raise
        print(f"vitlab: this vitlab does not choose a model; training {fallback}", flush=True)
        result, chose = vitlab.fit(fallback, arrays, **options), fallback
    summary = result.summary
    curve = [{"minutes": row["elapsed_seconds"] / 60, "top1": row["test_top1"], "images": None,
              "on": "its evaluation"} for row in result.history if row.get("test_top1") is not None]
    wall = time.perf_counter() - started
    train_seconds = result.history[-1]["elapsed_seconds"] if result.history else None
    curve.append({"minutes": (train_seconds if train_seconds is not None else wall) / 60, "top1": summary["top1"],
                  "images": summary.get("images"), "on": f"{summary['num_test']} test images"})
    images = summary.get("images")
    named = "" if chose == "auto" else " (named: this vitlab does not choose)"
    return {"arm": "vitlab", "what": f"vitlab.fit(data, time_budget={minutes:g}): {summary['model']}{named}",
            "curve": curve, "top1": summary["top1"], "images": images, "train_seconds": train_seconds,
            "images_per_second": images / train_seconds if images and train_seconds else None,
            "wall_seconds": wall, "out": str(result.out)}


# --- the comparison ---


def arm_main(args: argparse.Namespace) -> None:
    import torch
    torch.set_num_threads(args.threads)
    data = cached_arrays(args.archive, args.cache)
    x_train, y_train = per_class(data["x_train"], data["y_train"], args.train_images)
    x_test, y_test = per_class(data["x_test"], data["y_test"], args.test_images)
    data = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    if args.arm == "keras":
        found = run_keras(data, args.minutes, args.points, args.curve_images)
    else:
        found = run_vitlab(data, args.minutes, args.threads, args.out / "vitlab-run", args.cache, args.vitlab_model)
    found.update(train_images=len(y_train), test_images=len(y_test), threads=args.threads)
    (args.out / f"{args.arm}.json").write_text(json.dumps(found, indent=1))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    import platform
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def load_average() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "?"


def table(results: list[dict]) -> str:
    lines = ["| arm | minutes of training | test top-1 | scored on |", "| --- | --- | --- | --- |"]
    for found in results:
        for point in found["curve"]:
            lines.append(f"| {found['arm']} | {point['minutes']:.2f} | {100 * point['top1']:.2f}% | {point['on']} |")
    lines += ["", "| arm | what ran | test top-1 | images trained | images/s | training s | wall s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in results:
        ips = f"{f['images_per_second']:.1f}" if f.get("images_per_second") else "-"
        train = f"{f['train_seconds']:.0f}" if f.get("train_seconds") else "-"
        lines.append(f"| {f['arm']} | {f['what']} | {100 * f['top1']:.2f}% | {f.get('images') or '-'} | {ips} | "
                     f"{train} | {f['wall_seconds']:.0f} |")
    return "\n".join(lines)


def figure(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for found in results:
        ax.plot([p["minutes"] for p in found["curve"]], [100 * p["top1"] for p in found["curve"]], "o-",
                label=found["what"])
    ax.set_xlabel("minutes of training (each arm's clock)")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the budget of each arm (default 10)")
    p.add_argument("--train-images", type=int, default=None, help="a subset: this many training images, the same "
                   "number of each class (default: all 50,000)")
    p.add_argument("--test-images", type=int, default=None, help="a subset of the test images (default: all 10,000)")
    p.add_argument("--points", type=int, default=4, help="the tutorial's points on its curve, the last on the whole "
                   "test split (default 4)")
    p.add_argument("--curve-images", type=int, default=500, help="the test images the tutorial's earlier points are "
                   "scored on (default 500)")
    p.add_argument("--threads", type=int, default=1, help="threads of each arm (default 1)")
    p.add_argument("--vitlab-model", default="vit_tiny_patch4_32", help="the model vitlab trains where it cannot "
                   "choose one itself (default: the one a call without a model trains)")
    p.add_argument("--archive", type=Path, default=SHARED / "data" / "cifar10-jpg.tar.gz")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("VITLAB_CACHE", Path.home() / ".cache" /
                                                                      "vitlab")) / "fit-vs-keras")
    p.add_argument("--out", type=Path, default=Path("runs/fit-vs-keras"))
    p.add_argument("--arm", choices=("keras", "vitlab"), help=argparse.SUPPRESS)  # one arm, in its own process
    args = p.parse_args(argv)
    if not args.archive.is_file():
        p.error(f"no CIFAR-10 archive at {args.archive}; give --archive PATH (train/<class>/*.jpg, test/<class>/*.jpg)")
    if args.points < 1 or args.minutes <= 0:
        p.error("--points must be 1 or more and --minutes above 0")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        arm_main(args)
        return 0
    if importlib.util.find_spec("keras") is None:  # imported by the arm only, after KERAS_BACKEND is set
        p.error("keras is not installed: pip install 'vitlab[bench]' (or pip install keras)")
    cached_arrays(args.archive, args.cache)  # decoded once, before the arms start their clocks
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join(
               [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    forwarded = list(argv if argv is not None else sys.argv[1:])
    load_before = load_average()
    arms = {}
    for arm in ("keras", "vitlab"):
        log = open(args.out / f"{arm}.log", "w")  # noqa: SIM115 - closed when the arm ends
        arms[arm] = (subprocess.Popen([sys.executable, __file__, *forwarded, "--arm", arm], env=env, stdout=log,
                                      stderr=subprocess.STDOUT), log)
    failed = []
    for arm, (proc, log) in arms.items():
        if proc.wait() != 0:
            failed.append(arm)
        log.close()
    if failed:
        print(f"the {' and '.join(failed)} arm failed: see {', '.join(str(args.out / f'{a}.log') for a in failed)}")
        return 1
    results = [json.loads((args.out / f"{arm}.json").read_text()) for arm in arms]
    where = (f"{cpu_name()}, {args.threads} thread(s) each, the two arms side by side; load average "
             f"{load_before} at the start, {load_average()} at the end")
    data = f"CIFAR-10, {results[0]['train_images']} training / {results[0]['test_images']} test images"
    print(f"{data}, {args.minutes:g} minutes each; {where}\n")
    print(table(results))
    keras_top1_, vitlab_top1 = results[0]["top1"], results[1]["top1"]
    if keras_top1_ > 0:
        print(f"\nvitlab / the seed tutorial: {vitlab_top1 / keras_top1_:.2f}x the test top-1")
    figure(results, args.out / "fit_vs_keras.png", f"{data}, {args.minutes:g} min\n{cpu_name()}, {args.threads} thread")
    (args.out / "results.json").write_text(json.dumps({"where": where, "data": data, "minutes": args.minutes,
                                                       "arms": results}, indent=1))
    print(f"\nfigure: {args.out / 'fit_vs_keras.png'}; numbers: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
