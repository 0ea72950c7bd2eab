"""Datasets the upstream libraries lack, and the writers of the generated mini sets."""
from .mini_data import make_mini_ade, make_mini_all, make_mini_coco, make_mini_imagenet

__all__ = ['make_mini_ade', 'make_mini_all', 'make_mini_coco', 'make_mini_imagenet']
