"""What the training side asks of a model's structure, answered beside the models (timm's ``group_matcher``): the
layers it has in depth order and the layer of each parameter (layer-wise lr decay, freezing the first blocks), and
its patch embedding (the patch size and grid that resizing, fine-tuning at another size and checkpoints read), and
its classifiers (a fine-tune's new head, a linear probe's).

Every parameter gets a layer id: the input side (patch embedding, a hybrid's CNN backbone, position embedding,
class / distillation / register tokens; a ResNet's stem) is layer 0, block i is layer i + 1 (CaiT's
class-attention blocks count after its self-attention blocks, a ResNet's stage k is layer k, the members of the
stack a model names in ``layer_stack`` are its layers; airbench's conv groups), and everything after the last block
(final norm, fc_norm, the heads) is layer depth + 1.
"""
from __future__ import annotations

from torch import nn

from ..errors import VitlabError

# parameters (first name part) that are the input side of a model: layer 0
STEM_NAMES = ("patch_embed", "embeds", "pos_embed", "cls_token", "dist_token", "reg_token", "mask_token", "norm_pre",
              "conv1", "bn1", "stem")
# module lists whose members are the layers, in the order the input passes through them
BLOCK_STACKS = ("blocks", "blocks_token_only")


def layer_units(model: nn.Module) -> list[str]:
    """The name prefixes of the model's layers in depth order ('blocks.0', ..., or 'layer1', ...)."""
    units = []
    for stack in (*BLOCK_STACKS, getattr(model, "layer_stack", None)):
        blocks = model.get_submodule(stack) if stack and hasattr(model, stack.split(".")[0]) else None
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            units += [f"{stack}.{i}" for i in range(len(blocks))]
    k = 1
    while isinstance(getattr(model, f"layer{k}", None), nn.Module):  # a ResNet's stages
        units.append(f"layer{k}")
        k += 1
    if not units:
        raise VitlabError(f"{type(model).__name__} has neither transformer blocks nor ResNet stages; layer-wise "
                          "settings accept ViT, DeiT, CaiT, ConViT, hybrid ViT, ResNet and airbench models")
    return units


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: layer id}, depth): embeddings 0, the layers 1..depth, the rest depth + 1."""
    units = layer_units(model)
    unit_id = {name: i + 1 for i, name in enumerate(units)}
    depth = len(units)
    ids = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        unit = next((unit_id[p] for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)) if p in unit_id),
                    None)  # the longest prefix that is a layer
        ids[name] = unit if unit is not None else 0 if parts[0] in STEM_NAMES else depth + 1
    return ids, depth


def patch_embedding(model: nn.Module) -> nn.Module | None:
    """The model's patch embedding (``patch_size``, ``grid_size``, ``img_size``, its ``proj``); None for a model
    without one (a CNN, or an objective around a model)."""
    return getattr(model, "patch_embed", None)


def classifiers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's classifier layers by name (its ``classifier_names``: 'head', DeiT's 'head_dist', a ResNet's 'fc')."""
    heads = {name: getattr(model, name, None) for name in getattr(model, "classifier_names", ())}
    return {name: m for name, m in heads.items() if isinstance(m, nn.Linear)}
