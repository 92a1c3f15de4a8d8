"""Write tests/fixtures/hf_model_types.json: transformers' ViT-family model types, so a new one is never missed.

The ViT-family image encoders among the names of transformers' CONFIG_MAPPING (plain ViTs under other key
names, DINO, CLIP/SigLIP image towers, BEiT, masked-image pretraining encoders, ...), and those of the list
that transformers no longer has (vit-hybrid left in version 5). tests/test_hf_model_types.py walks them: each
is read by vitlab or refused in one line naming what vitlab lacks.

Runs only in the reference environment, from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/list_hf_model_types.py
"""
import json
import re
import sys
from pathlib import Path

import transformers
from transformers import CONFIG_MAPPING

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_model_types.json"
# the ViT family: image encoders made of pre-norm ViT blocks on a patch embedding
VIT_FAMILY = ("vit", "deit", "vit-hybrid", "vit_msn", "vit_mae", "ijepa", "dinov2", "dinov2_with_registers",
              "dinov3_vit", "clip_vision_model", "metaclip_2_vision_model", "siglip_vision_model",
              "siglip2_vision_model", "aimv2_vision_model", "beit", "data2vec-vision", "vitdet")
# names that look alike but are left out, stored so that the choice can be reviewed at each transformers version:
# convnets (mobilevit, levit), video (vivit, videomae), detection/segmentation/pose models, speech (vits), and
# the image towers of other multimodal models (AltCLIP, Chinese-CLIP, OWL-ViT, X-CLIP, GroupViT)
LOOK_ALIKE = re.compile(r"vit|deit|dino|beit|clip_vision|siglip.*vision|mae|msn")


def main() -> int:
    known = set(CONFIG_MAPPING.keys())
    present = [t for t in VIT_FAMILY if t in known]
    gone = [t for t in VIT_FAMILY if t not in known]
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "model_types": present,
                               "no_longer_in_transformers": gone,
                               "look_alike_left_out": sorted(t for t in known if LOOK_ALIKE.search(t) and
                                                             t not in VIT_FAMILY)}, indent=0) + "\n")
    print(f"{len(present)} model types, {len(gone)} no longer in transformers ({', '.join(gone)}) -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
