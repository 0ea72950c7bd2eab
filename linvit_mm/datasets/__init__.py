"""Datasets the upstream libraries lack.

Importing the package registers ``STL10`` and ``ImageNetV2`` in mmpretrain's DATASETS
(``custom_imports=dict(imports=['linvit_mm.datasets'])``). The generated mini sets of the
tests and the demo are written by ``linvit_mm.testing.mini_data``.
"""
from .imagenet_variants import ImageNetV2
from .stl10 import STL10

__all__ = ['ImageNetV2', 'STL10']
