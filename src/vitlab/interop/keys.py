"""What the key maps of transformers' folders share: query, key and value joined into qkv, unplaced tensors named,
sizes written as transformers' configs write them."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import VitlabError


def join_qkv(out: dict[str, torch.Tensor], qkv: dict[tuple[int, str], dict[int, torch.Tensor]]) -> None:
    """Each layer's query, key and value tensors (0, 1, 2) concatenated as ``blocks.i.attn.qkv.<param>``."""
    for (i, param), parts in qkv.items():
        if len(parts) < 3:
            raise VitlabError(f"layer {i} attention {param} lacks one of query, key, value")
        out[f"blocks.{i}.attn.qkv.{param}"] = torch.cat([parts[0], parts[1], parts[2]], dim=0)


def place_layer(block: int, sub: str, v: torch.Tensor, out: dict[str, torch.Tensor],
                qkv: dict[tuple[int, str], dict[int, torch.Tensor]], qkv_parts: dict[str, int],
                layer_keys: dict[str, str]) -> bool:
    """One tensor of layer ``block`` (``sub``: its module path and parameter, as the Hub names them under the layer)
    put in place: a query, key or value part (``qkv_parts``: module -> 0, 1, 2) into ``qkv`` for join_qkv, a module
    ``layer_keys`` names into ``out`` as ``blocks.<block>.<name>.<param>``. False when neither names it."""
    mod, _, param = sub.rpartition(".")
    if mod in qkv_parts:
        qkv.setdefault((block, param), {})[qkv_parts[mod]] = v
    elif mod in layer_keys:
        out[f"blocks.{block}.{layer_keys[mod]}.{param}"] = v
    else:
        return False
    return True


def check_placed(unknown: list[str], model_type: str) -> None:
    """One line naming the tensors (the first eight) that have no place in the model."""
    if unknown:
        raise VitlabError(f"tensors with no place in a {model_type} model: {', '.join(unknown[:8])}"
                          + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))


def hf_size(v: Any) -> int | list[int]:
    """An image or patch size as transformers' configs write it: one int where square, else [height, width]."""
    v = list(v) if isinstance(v, (list, tuple)) else [int(v), int(v)]
    return int(v[0]) if v[0] == v[1] else [int(x) for x in v]
