"""TensorBoard event files for a run: scalars per epoch and the run's figures, in RUN/tb/.

``tensorboard --logdir RUN/tb`` (or a folder of runs) shows them. Needs the optional extra:
``pip install 'vitlab[tensorboard]'``.
"""
from __future__ import annotations

import math
import numbers
from pathlib import Path

from ..errors import VitlabError

INSTALL_HINT = "pip install 'vitlab[tensorboard]'"
TB_DIR = "tb"


class TensorBoardLog:
    """Writes scalars and PNG figures of a run to run_dir/tb as TensorBoard event files."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise VitlabError(f"--log tensorboard needs the tensorboard package: {INSTALL_HINT}") from None
        self.dir = Path(run_dir) / TB_DIR
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        """One point per numeric value (tag = prefix + key); other values (lists, strings, None) are skipped."""
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                continue
            self.writer.add_scalar(f"{prefix}{key}", float(value), global_step=step)
        self.writer.flush()

    def image(self, tag: str, png_path: Path, step: int) -> None:
        """A PNG file as an image summary, its bytes as they are (no decoding and re-encoding)."""
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        png_path = Path(png_path)
        with Image.open(png_path) as im:
            width, height = im.size
            channels = len(im.getbands())
        picture = Summary.Image(height=height, width=width, colorspace=channels,
                                encoded_image_string=png_path.read_bytes())
        summary = Summary(value=[Summary.Value(tag=tag, image=picture)])
        self.writer.file_writer.add_summary(summary, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
