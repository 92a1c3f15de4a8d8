"""Pre-training runs: the run folder's objective (encoder + pretrain.safetensors), the pre-training command on
an unlabelled folder, resume after kill -9, fine-tuning from a pre-training run, and the families it refuses."""
import pytest
import torch

import vitlab
from vitlab.pretrain import create_objective, load_objective, save_objective
from vitlab.runs.format import PRETRAIN_WEIGHTS, read_pretrain


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def encoder(**kw):
    return vitlab.create_model("vit_micro_patch2_8", num_classes=0, **kw)


@pytest.mark.parametrize("method,options", [("mae", {"mask_ratio": 0.5, "decoder_depth": 1}),
                                            ("mpp", {"mean": [0.3], "std": [0.2]})])
def test_a_saved_objective_loads_back_whole_in_eval_mode(tmp_path, method, options):
    objective = create_objective(method, encoder(), **options)
    save_objective(objective, tmp_path, method, options)
    assert read_pretrain(tmp_path)[:2] == (method, options)
    assert not any(k.startswith("encoder.") for k in read_pretrain(tmp_path)[2])  # the encoder is the model
    loaded = load_objective(tmp_path)
    assert type(loaded) is type(objective) and loaded.method == method and not loaded.training
    saved, back = objective.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    model = vitlab.load(tmp_path)  # the encoder alone is a model vitlab reads, without a head
    assert model.num_classes == 0
    x = torch.randn(2, 1, 8, 8)
    first, again = (m(x, generator=torch.Generator().manual_seed(0)).loss for m in (objective.eval(), loaded))
    assert torch.equal(first, again)


def test_a_folder_without_or_with_a_broken_pretrain_file_is_one_line(tmp_path):
    vitlab.save(encoder(), tmp_path)
    with pytest.raises(FileNotFoundError, match="not a finished pre-training run"):
        load_objective(tmp_path)
    (tmp_path / PRETRAIN_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_objective(tmp_path)


def test_a_decoder_of_another_shape_is_refused(tmp_path):
    objective = create_objective("mae", encoder(), decoder_depth=1)
    save_objective(objective, tmp_path, "mae", {"decoder_depth": 1})
    method, _, rest = read_pretrain(tmp_path)
    from vitlab.runs.format import write_pretrain
    write_pretrain(tmp_path, method, {"decoder_depth": 2}, rest)
    with pytest.raises(ValueError, match="does not fit"):
        load_objective(tmp_path)
