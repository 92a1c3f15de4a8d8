"""The ViT family: ViT/DeiT, ConViT, CaiT, hybrid ViT, CCT, and ResNet teachers."""
from .cait import Cait
from .cct import CompactTransformer
from .convit import ConVit
from .hybrid import HybridVisionTransformer
from .registry import create_model, list_models
from .resnet import ResNet
from .vit import VisionTransformer

__all__ = ["Cait", "CompactTransformer", "ConVit", "HybridVisionTransformer", "ResNet", "VisionTransformer",
           "create_model", "list_models"]
