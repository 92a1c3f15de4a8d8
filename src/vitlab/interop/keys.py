"""What the key maps of transformers' folders share: query, key and value joined into qkv, unplaced tensors named."""
from __future__ import annotations

import torch


def join_qkv(out: dict[str, torch.Tensor], qkv: dict[tuple[int, str], dict[int, torch.Tensor]]) -> None:
    """Each layer's query, key and value tensors (0, 1, 2) concatenated as ``blocks.i.attn.qkv.<param>``."""
    for (i, param), parts in qkv.items():
        if len(parts) < 3:
            raise ValueError(f"layer {i} attention {param} lacks one of query, key, value")
        out[f"blocks.{i}.attn.qkv.{param}"] = torch.cat([parts[0], parts[1], parts[2]], dim=0)


def check_placed(unknown: list[str], model_type: str) -> None:
    """One line naming the tensors (the first eight) that have no place in the model."""
    if unknown:
        raise ValueError(f"tensors with no place in a {model_type} model: {', '.join(unknown[:8])}"
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
