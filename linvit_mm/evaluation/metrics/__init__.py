from .subset_accuracy import IMAGENET_SUBSETS, SubsetAccuracy, imagenet_subset

__all__ = ['IMAGENET_SUBSETS', 'SubsetAccuracy', 'imagenet_subset']
