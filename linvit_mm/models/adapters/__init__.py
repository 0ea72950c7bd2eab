"""ViT-Adapter for dense prediction with any LinearViT operator."""
from .extractor import ConvFFN, Extractor
from .injector import Injector
from .interaction_block import InteractionBlock
from .linear_vit_adapter import LinearViTAdapter
from .plain_pyramid import LinearViTPlainPyramid
from .spatial_prior import SpatialPriorModule

__all__ = [
    'ConvFFN', 'Extractor', 'Injector', 'InteractionBlock', 'LinearViTAdapter',
    'LinearViTPlainPyramid', 'SpatialPriorModule'
]
