"""Generated bad input, seeded so that every run throws the same cases: garbled weights at vitlab.load, garbled
checkpoints at `vitlab train --resume`, values for the CLI's numeric and choice options. A result or one line naming
the problem (exit 2), never a traceback, and no input file changed. Data sources are fuzzed in test_faults.py."""
from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest
from conftest import checksums, error_line, run_cli

import vitlab
from vitlab.cli import main

SEED = 21


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_line(message):
    text = str(message).strip()
    return bool(text) and "\n" not in text and "Traceback" not in text


def assert_clean(ran, argv):
    """A result, or an error line last (exit 2); run_cli has checked that no traceback came."""
    assert ran.code in (0, 2), (argv, ran)
    if ran.code == 2:
        assert ran.lines and ran.lines[-1].startswith("vitlab") and "error" in ran.lines[-1], (argv, ran)


def garble(rng, data):
    """Bytes truncated, with bytes flipped, or both."""
    data = bytearray(data)
    kind = rng.randrange(3)
    if kind in (0, 2):
        data = data[:rng.randrange(len(data))]
    if kind in (1, 2) and data:
        for _ in range(rng.randrange(1, 16)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vitlab.save(vitlab.create_model("vit_micro_patch2_8", embed_dim=16, depth=1, num_heads=2),
                       tmp_path_factory.mktemp("fuzz") / "model")


def load_or_one_line(folder):
    """vitlab.load on a folder, its files hashed before and after: loads, or one line of ValueError/FileNotFound."""
    before = checksums(folder)
    try:
        vitlab.load(folder)
    except (ValueError, FileNotFoundError) as e:
        assert one_line(e), repr(e)
    assert checksums(folder) == before


def test_garbled_weights_load_or_are_one_line(tmp_path, model_dir):
    rng = random.Random(SEED + 1)
    weights = (model_dir / "model.safetensors").read_bytes()
    cfg = json.loads((model_dir / "config.json").read_text())
    for i in range(60):
        folder = tmp_path / f"w{i}"
        shutil.copytree(model_dir, folder)
        (folder / "model.safetensors").write_bytes(garble(rng, weights))
        if i % 2:  # without the recorded hash, the file itself must be judged
            (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "sha256"}))
        load_or_one_line(folder)


@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory):
    """A run folder of one epoch whose summary.json is gone: `--resume` reads its checkpoint.pt."""
    root = tmp_path_factory.mktemp("fuzzrun")
    run = root / "run"
    assert main(["train", "--model", "vit_micro_patch2_8", "--model-arg", "embed_dim=16", "--model-arg", "depth=1",
                 "--model-arg", "num_heads=2", "--epochs", "1", "--batch-size", "128", "--precision", "fp32",
                 "--threads", "1", "--cache-dir", str(root / "cache"), "--out", str(run)]) == 0
    (run / "summary.json").unlink()
    return run


def test_garbled_checkpoints_resume_or_are_one_line(tmp_path, capsys, unfinished_run):
    rng = random.Random(SEED + 2)
    data = (unfinished_run / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    for i in range(40):
        run = tmp_path / f"r{i}"
        shutil.copytree(unfinished_run, run)
        (run / "checkpoint.pt").write_bytes(garble(rng, data) if i % 4 else rng.randbytes(rng.randrange(256)))
        before = digest(run / "checkpoint.pt")
        argv = ["train", "--resume", str(run)]
        assert_clean(run_cli(capsys, argv), argv)
        assert digest(run / "checkpoint.pt") == before


VALUES = ["-1", "0", "1", "3", "1.5", "-0", "nan", "inf", "-inf", "1e309", "1e-3", "abc", "", " ", "0x10", "null",
          "true", "[1]", "9" * 30, "auto", "cpu", "cuda", "fp16", "bf16", "fp32", "tensorboard", "hard"]
TRAIN_OPTIONS = ["--epochs", "--batch-size", "--lr", "--min-lr", "--warmup", "--drop-path", "--time-budget",
                 "--accum-steps", "--img-size", "--ema-decay", "--val-fraction", "--train-fraction", "--seed",
                 "--threads", "--precision", "--device", "--log", "--distill", "--eval-every", "--mixup",
                 "--label-smoothing", "--workers", "--store-size", "--crop-pct", "--tau", "--alpha"]


def test_generated_option_values_are_a_result_or_one_line(tmp_path, capsys):
    """Values for numeric and choice options, one to three at a time; the data (or model) named does not exist, so
    a command line that passes every check ends in a one-line error too, and nothing is trained."""
    rng = random.Random(SEED + 3)
    missing = str(tmp_path / "no-such-data")
    for i in range(200):
        command = rng.choice(["train", "train", "train", "eval", "predict"])
        if command == "train":
            argv = ["train", "--data", missing, "--out", str(tmp_path / f"o{i}")]
            for option in rng.sample(TRAIN_OPTIONS, rng.randrange(1, 4)):
                argv += [option, rng.choice(VALUES)]
        elif command == "eval":
            argv = ["eval", missing, "--data", "digits", rng.choice(["--batch-size", "--precision", "--device"]),
                    rng.choice(VALUES)]
        else:
            argv = ["predict", missing, "x.png", "--top-k", rng.choice(VALUES)]
        error_line(capsys, argv, after_log=True)


def mutate_config(rng, cfg):
    """A copy of a config.json with one value, or one value of its argument tables, of another kind or size."""
    values = [None, True, -1, 0, 3, 7, 513, 2.5, float("nan"), "", "x", "vit_micro_patch2_8", [], [1, 2], {},
              {"a": 1}, [[1]], "resnet18"]
    cfg = json.loads(json.dumps(cfg))
    table = rng.choice([cfg, cfg, cfg.setdefault("model_args", {}), cfg.setdefault("pretrained_cfg", {})])
    keys = list(table) + ["architecture", "class", "library", "img_size", "patch_size", "embed_dim", "depth",
                          "num_heads", "num_classes", "global_pool", "pos_embed", "reg_tokens", "in_chans"]
    table[rng.choice(keys)] = rng.choice(values)
    return cfg


def test_mutated_configs_load_or_fail_in_one_line(model_dir, tmp_path):
    rng = random.Random(SEED)
    base = json.loads((model_dir / "config.json").read_text())
    for i in range(150):
        folder = tmp_path / str(i)
        shutil.copytree(model_dir, folder)
        (folder / "config.json").write_text(json.dumps(mutate_config(rng, base)))
        before = checksums(folder)
        try:
            vitlab.load(folder)
        except (ValueError, FileNotFoundError) as e:
            assert one_line(e), (i, e)
        assert checksums(folder) == before
        shutil.rmtree(folder)


# ----------------------------------------------------------------------------------------------
# recipe files, model arguments, the cache commands


RECIPE_VALUES = [None, True, False, 0, 1, -1, 3, 2.5, float("nan"), "1e-3", "", "abc", "yes", [], [1, 2], {},
                 {"depth": 1}, {"depth": "six"}, "digits"]


def test_generated_recipe_files_are_one_line(tmp_path, capsys):
    """YAML recipes of one to four options (known and unknown names, values of every kind, nested augment and
    model_args); the data named does not exist, so a recipe that passes every check ends in one line too."""
    import yaml

    from vitlab.train.recipe import AUGMENT_FIELDS, FIELDS
    rng = random.Random(SEED + 4)
    names = [*FIELDS, *AUGMENT_FIELDS, "epoch", "augment", "model_args"]
    missing = str(tmp_path / "no-such-data")
    for i in range(120):
        values = {name: rng.choice(RECIPE_VALUES) for name in rng.sample(names, rng.randrange(1, 5))}
        recipe = tmp_path / f"r{i}.yaml"
        recipe.write_text(yaml.safe_dump(values))
        before = digest(recipe)
        argv = ["train", "--config", str(recipe), "--data", missing, "--out", str(tmp_path / f"o{i}")]
        error_line(capsys, argv)
        assert digest(recipe) == before and not (tmp_path / f"o{i}").exists()


MODEL_ARG_VALUES = [None, True, 0, 1, 2, -8, 3, 7, 16, 0.5, 2.5, float("nan"), float("inf"), 10 ** 30, "", "six",
                    "gelu", "avg", [], [4, 4], [4, 4, 4], {}]


def test_generated_model_arguments_build_or_are_one_line():
    """One to three of a model's own arguments (and an unknown one) set to values of every kind and size: a model,
    or one line naming the problem."""
    from vitlab.models.registry import accepted_args, get_spec
    rng = random.Random(SEED + 5)
    names = [*accepted_args(get_spec("vit_micro_patch2_8").cls), "depht"]
    built = refused = 0
    for _ in range(150):
        args = {name: rng.choice(MODEL_ARG_VALUES) for name in rng.sample(names, rng.randrange(1, 4))}
        try:
            vitlab.create_model("vit_micro_patch2_8", **args)
            built += 1
        except ValueError as e:
            assert one_line(e), (args, e)
            refused += 1
    assert built and refused


def test_generated_cache_commands_never_touch_the_users_files(tmp_path, capsys):
    """A cache folder holding the user's own files among vitlab's stores (some superseded), under every cache
    command: exit 0, and every file of the user's byte for byte the same."""
    from vitlab.data import load_data
    rng = random.Random(SEED + 6)
    cache, data = tmp_path / "cache", tmp_path / "data"
    for c in "ab":
        (data / c).mkdir(parents=True)
        for i in range(3):
            (data / c / f"{i}.pgm").write_bytes(b"P5 4 4 255\n" + bytes([40 * i + (c == "b") * 100] * 16))
    load_data(str(data), cache_dir=cache, log=lambda s: None)
    user = {"notes/header.json": b'{"magic": "vitlab-image-store"}', "archive.tar.gz": b"x" * 64,
            ".plan.json.ab12cd34.tmp": b"{", "features/features-0123456789abcdef.safetensors": b"mine"}
    store = next(p for p in cache.iterdir() if p.is_dir())
    user[f"{store.name}/my-notes.txt"] = b"kept"
    for rel, content in user.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(content)
    for i in range(12):
        if i % 3 == 0:  # supersede the store now and then
            (data / "a" / "0.pgm").write_bytes(b"P5 4 4 255\n" + bytes([i] * 16))
            load_data(str(data), cache_dir=cache, log=lambda s: None)
        argv = ["cache", rng.choice(["list", "clean"]), "--cache-dir", str(cache)]
        argv += [flag for flag in ("--all", "--dry-run", "--json") if rng.random() < 0.4]
        code, err, _ = run_cli(capsys, argv)
        assert code == 0 and not err, (argv, err)
        assert {rel: (cache / rel).read_bytes() for rel in user} == user, argv
