"""The ViT family: ViT/DeiT, BEiT, EVA02 and RoPE ViTs, ConViT, CaiT, hybrid ViTs, CCT, MLP-Mixer, and ResNet and
airbench CNNs."""
from .airbench import AirBench
from .airbench_hybrid import AirBenchHybrid
from .beit import Beit
from .cait import Cait
from .cct import CompactTransformer
from .convit import ConVit
from .eva import Eva
from .hybrid import HybridVisionTransformer
from .mixer import MlpMixer
from .registry import create_model, list_models
from .resnet import ResNet
from .resnetv2 import ResNetV2VisionTransformer
from .vit import VisionTransformer

__all__ = ["AirBench", "AirBenchHybrid", "Beit", "Cait", "CompactTransformer", "ConVit", "Eva",
           "HybridVisionTransformer", "MlpMixer", "ResNet", "ResNetV2VisionTransformer", "VisionTransformer",
           "create_model", "list_models"]
