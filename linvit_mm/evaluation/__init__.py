"""Metrics the upstream libraries lack (registered in mmpretrain's METRICS on import)."""
from .metrics import IMAGENET_SUBSETS, SubsetAccuracy, imagenet_subset

__all__ = ['IMAGENET_SUBSETS', 'SubsetAccuracy', 'imagenet_subset']
