"""Datasets the upstream libraries lack, and the writers of the generated mini sets.

Importing the package registers ``STL10`` and ``ImageNetV2`` in mmpretrain's DATASETS
(``custom_imports=dict(imports=['linvit_mm.datasets'])``). ``mini_data`` itself stays free
of the task libraries.
"""
from .imagenet_variants import ImageNetV2
from .mini_data import make_mini_ade, make_mini_all, make_mini_coco, make_mini_imagenet
from .stl10 import STL10

__all__ = [
    'ImageNetV2', 'STL10', 'make_mini_ade', 'make_mini_all', 'make_mini_coco',
    'make_mini_imagenet'
]
