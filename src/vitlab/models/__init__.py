"""The ViT family: ViT/DeiT, BEiT, ConViT, CaiT, hybrid ViTs, CCT, MLP-Mixer, and ResNet and airbench CNNs."""
from .airbench import AirBench
from .airbench_hybrid import AirBenchHybrid
from .beit import Beit
from .cait import Cait
from .cct import CompactTransformer
from .convit import ConVit
from .hybrid import HybridVisionTransformer
from .mixer import MlpMixer
from .registry import create_model, list_models
from .resnet import ResNet
from .resnetv2 import ResNetV2VisionTransformer
from .vit import VisionTransformer

__all__ = ["AirBench", "AirBenchHybrid", "Beit", "Cait", "CompactTransformer", "ConVit", "HybridVisionTransformer",
           "MlpMixer", "ResNet", "ResNetV2VisionTransformer", "VisionTransformer",
           "create_model", "list_models"]
