"""Write tests/fixtures/timm_names.json: every ViT-family name timm has, so a new one is never silently missed.

The names timm.list_models gives for the ViT families (``vit_*``, ``deit*``, ``eva*``, ``beit*``, ``mixer*``,
``flexivit*``), and the pretrained weights' tags of each (``vit_base_r50_s16_384.orig_in21k_ft_in1k``).
tests/test_timm_names.py walks them: each builds in vitlab or is refused in one line naming what vitlab lacks.

Runs only in the reference environment, from the repository root:

    PY=$(../shared/tools/reference-env.sh) && $PY benchmarks/list_timm_names.py
"""
import json
import sys
from pathlib import Path

import timm

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "timm_names.json"
PATTERNS = ("vit_*", "deit*", "eva*", "beit*", "mixer*", "flexivit*")


def main() -> int:
    names = sorted({n for p in PATTERNS for n in timm.list_models(p)})
    tags = sorted({n for p in PATTERNS for n in timm.list_models(p, pretrained=True)})
    OUT.write_text(json.dumps({"timm": timm.__version__, "patterns": PATTERNS, "names": names,
                               "pretrained": tags}, indent=0) + "\n")
    print(f"{len(names)} names, {len(tags)} pretrained tags -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
