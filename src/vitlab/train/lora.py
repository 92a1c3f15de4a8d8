"""LoRA fine-tuning through Hugging Face peft: adapters on named Linear layers, the head fully trained, and the
adapter merged back at the end so every reader of the run sees an ordinary model."""
from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import VitlabError
from ..runs.format import ADAPTER_DIR

if TYPE_CHECKING:
    from .recipe import Recipe

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # timm's names: the fused attention input and output, the MLP's two
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names


def peft_module():
    """The peft package, or one line naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise VitlabError("--lora needs Hugging Face peft: pip install 'vitlab[lora]'") from None
    return peft


def lora_config(rank: int, alpha: float | None, targets: Sequence[str]):
    """peft's LoraConfig for the recipe's rank, alpha (default: the rank) and target layer names."""
    peft = peft_module()
    return peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                           lora_dropout=0.0, bias="none")


def apply_lora(model: nn.Module, recipe: Recipe, log: Callable[[str], None]) -> None:
    """Inject LoRA adapters into the recipe's target layers (in place, the model's names kept) and train only them
    and the classifier head(s); log how many parameters train."""
    peft = peft_module()
    targets = [t.strip() for t in recipe.lora_targets.split(",") if t.strip()]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
              and n.split(".")[0] not in model.classifier_names]
    names = {n.rsplit(".", 1)[-1] for n in linear}
    if not names:
        raise VitlabError(f"lora={recipe.lora}: LoRA adapts Linear layers, and {type(model).__name__} has none outside "
                          "its head (a convolutional network); accepted: a model with Linear layers (a ViT), or "
                          "fine-tuning without --lora")
    missing = [t for t in targets if t not in names]
    if missing:
        raise VitlabError(f"lora_targets {', '.join(missing)}: {type(model).__name__} has no Linear layer of that "
                          f"name; accepted: {', '.join(sorted(names))}")
    # the Linear layers by full name: a ViT's patch embedding is a Conv2d also named proj
    chosen = [n for n in linear if n.rsplit(".", 1)[-1] in targets]
    modules = dict(model.named_modules())
    width, narrowest = min((min(modules[n].in_features, modules[n].out_features), n) for n in chosen)
    if recipe.lora > width:  # a rank beyond a layer's width adds parameters, never expressiveness
        raise VitlabError(f"lora={recipe.lora} is above the width of {narrowest} ({modules[narrowest].in_features} in, "
                          f"{modules[narrowest].out_features} out); accepted: a rank of 1..{width} for these "
                          "lora_targets (a few, e.g. 4 to 16, is LoRA's use)")
    config = lora_config(recipe.lora, recipe.lora_alpha, chosen)
    peft.inject_adapter_in_model(config, model)
    model.lora_config = config
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name or name.split(".")[0] in model.classifier_names
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    log(f"LoRA rank {recipe.lora} (alpha {config.lora_alpha:g}) on {', '.join(targets)}: {trained:,} of {total:,} "
        "parameters trainable")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under peft's saved names (``base_model.model.<layer>.lora_A.weight``)."""
    out = {}
    for name, p in model.state_dict().items():
        if "lora_" in name:
            out["base_model.model." + name.replace(".default.", ".")] = p.detach().cpu().contiguous()
    return out


@torch.no_grad()
def merged(model: nn.Module) -> nn.Module:
    """A copy of the model with every adapter merged into its layer and the layer put back: a plain model."""
    from peft.tuners.lora import LoraLayer

    plain = copy.deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent) if parent else plain, child, module.get_base_layer())
    plain.__dict__.pop("lora_config", None)
    plain.__dict__.pop("peft_config", None)
    for p in plain.parameters():
        p.requires_grad = True
    return plain


def save_adapter(model: nn.Module, out: Path) -> Path:
    """Write peft's adapter folder (adapter_model.safetensors + adapter_config.json) under the run folder."""
    folder = out / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.lora_config.to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    config["peft_type"], config["task_type"] = "LORA", None
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return folder


def finish_lora(model: nn.Module, out: Path, log: Callable[[str], None]) -> nn.Module:
    """At the end of a LoRA run: save the adapter, and return the merged model the run folder keeps."""
    if getattr(model, "lora_config", None) is None:
        return model
    folder = save_adapter(model, out)
    log(f"LoRA adapter saved to {folder}; the model folder holds the merged model")
    return merged(model)
