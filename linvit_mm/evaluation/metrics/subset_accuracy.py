"""Accuracy of a 1000-class ImageNet classifier on a test set that covers fewer classes.

ImageNet-A (Hendrycks et al., CVPR 2021) and ImageNet-R (Hendrycks et al., ICCV 2021) hold
200 of the 1000 ImageNet-1k classes. Their protocol scores a 1k classifier by the argmax
over the logits of those 200 classes only. Softmax is monotonic, so ranking the 200 softmax
scores (mmpretrain's ``pred_score``) gives the same prediction as ranking the logits.
"""
import functools
import importlib.resources
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from mmengine.evaluator import BaseMetric

from mmpretrain.registry import METRICS

IMAGENET_SUBSETS = ('imagenet-a', 'imagenet-r')
_WNID = re.compile(r'^n\d{8}$')


def _read_timm_info(filename: str) -> List[str]:
    # timm ships the subset definitions beside its ImageNet class lists.
    path = importlib.resources.files('timm.data').joinpath('_info', filename)
    return path.read_text().split()


@functools.lru_cache(maxsize=None)
def imagenet_subset(name: str) -> Tuple[Tuple[str, ...], Tuple[int, ...]]:
    """The wnids of a 200-class ImageNet subset and their ImageNet-1k class indices.

    Both come in sorted wnid order: the label order that ``CustomDataset`` gives the wnid
    folders of the extracted archive.

    Args:
        name (str): ``'imagenet-a'`` or ``'imagenet-r'``.
    """
    if name not in IMAGENET_SUBSETS:
        raise ValueError(f'unknown ImageNet subset {name!r}; choose one of '
                         f'{list(IMAGENET_SUBSETS)}')
    stem = name.replace('-', '_')
    wnids = _read_timm_info(f'{stem}_synsets.txt')
    indices = [int(index) for index in _read_timm_info(f'{stem}_indices.txt')]
    imagenet_wnids = _read_timm_info('imagenet_synsets.txt')
    if len(wnids) != len(indices):
        raise RuntimeError(f"timm's {stem}_synsets.txt and {stem}_indices.txt disagree in "
                           f'length ({len(wnids)} vs {len(indices)})')
    # ImageNet-1k labels are the positions in the sorted wnid list; the shipped indices
    # must agree with that, or scores would be read from the wrong classes.
    position = {wnid: index for index, wnid in enumerate(sorted(imagenet_wnids))}
    wrong = [(wnid, index) for wnid, index in zip(wnids, indices) if position.get(wnid) != index]
    if wrong:
        raise RuntimeError(f"timm's {stem} indices do not match the sorted ImageNet-1k "
                           f'wnids for {wrong[:5]}')
    pairs = sorted(zip(wnids, indices))
    return tuple(wnid for wnid, _ in pairs), tuple(index for _, index in pairs)


@METRICS.register_module()
class SubsetAccuracy(BaseMetric):
    """Top-k accuracy of full-width class scores restricted to a subset of the classes.

    Label ``i`` of the dataset stands for class ``class_indices[i]`` of the classifier; the
    prediction is the best of the subset scores, whatever the scores outside the subset.

    Args:
        subset (str, optional): ``'imagenet-a'`` or ``'imagenet-r'``: the 200 classes of
            that set, in sorted wnid order, as ``CustomDataset`` labels its folders. Read
            from timm's class lists.
        class_indices (Sequence[int], optional): The classifier classes of the dataset
            labels 0, 1, ..., instead of ``subset``. Give exactly one of the two.
        topk (int | Sequence[int]): The k of each top-k accuracy. Defaults to 1.
        num_classes (int): Width of the classifier's ``pred_score``. Defaults to 1000.
        collect_device (str): ``'cpu'`` or ``'gpu'``, for gathering results across ranks.
        prefix (str, optional): Prefix of the result names. Defaults to ``'accuracy'``, so
            the results read ``accuracy/top1`` like mmpretrain's ``Accuracy``.

    Examples:
        >>> val_evaluator = dict(type='SubsetAccuracy', subset='imagenet-a', topk=(1, 5))
    """

    default_prefix: Optional[str] = 'accuracy'

    def __init__(self,
                 subset: Optional[str] = None,
                 class_indices: Optional[Sequence[int]] = None,
                 topk: Union[int, Sequence[int]] = (1, ),
                 num_classes: int = 1000,
                 collect_device: str = 'cpu',
                 prefix: Optional[str] = None) -> None:
        super().__init__(collect_device=collect_device, prefix=prefix)
        if (subset is None) == (class_indices is None):
            raise ValueError('SubsetAccuracy needs exactly one of `subset` '
                             f'({list(IMAGENET_SUBSETS)}) and `class_indices`')
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f'num_classes must be a positive int, got {num_classes!r}')
        self.num_classes = num_classes
        self.subset = subset
        if subset is not None:
            self.wnids, indices = imagenet_subset(subset)
        else:
            self.wnids, indices = None, self._check_indices(class_indices, num_classes)
        if max(indices) >= num_classes:
            raise ValueError(f'the subset reaches class {max(indices)}, beyond the '
                             f'{num_classes} classes of num_classes')
        self.class_indices = tuple(indices)
        self._index = torch.tensor(self.class_indices, dtype=torch.long)

        topk = (topk, ) if isinstance(topk, int) else tuple(topk)
        bad = [k for k in topk
               if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(indices)]
        if not topk or bad:
            raise ValueError(f'topk must be ints in 1..{len(indices)} (the subset size), '
                             f'got {topk}')
        self.topk = topk

    @staticmethod
    def _check_indices(class_indices, num_classes) -> Tuple[int, ...]:
        if isinstance(class_indices, (str, bytes)) or not isinstance(class_indices, Sequence):
            raise TypeError('class_indices must be a sequence of ints, got '
                            f'{type(class_indices).__name__}')
        indices = tuple(class_indices)
        if not indices or not all(isinstance(i, int) and not isinstance(i, bool)
                                  for i in indices):
            raise ValueError(f'class_indices must be a non-empty sequence of ints, got '
                             f'{class_indices!r}')
        if min(indices) < 0:
            raise ValueError(f'class_indices must be >= 0, got {min(indices)}')
        if len(set(indices)) != len(indices):
            raise ValueError('class_indices repeats a class')
        return indices

    @property
    def dataset_meta(self) -> Optional[dict]:
        return self._dataset_meta

    @dataset_meta.setter
    def dataset_meta(self, dataset_meta: Optional[dict]) -> None:
        # The runner hands over the dataset's metainfo: catch a data_root that points at
        # another set (ImageNet-R folders scored as ImageNet-A) before any result is made.
        classes = (dataset_meta or {}).get('classes')
        if classes is not None:
            classes = tuple(classes)
            if len(classes) != len(self.class_indices):
                raise ValueError(f'the dataset has {len(classes)} classes, but SubsetAccuracy '
                                 f'scores {len(self.class_indices)}')
            if self.wnids is not None and all(_WNID.match(str(c)) for c in classes) \
                    and classes != self.wnids:
                unknown = sorted(set(classes) - set(self.wnids))
                raise ValueError(f'the dataset folders are not the {self.subset} classes in '
                                 f'sorted order (e.g. {unknown[:3] or "order differs"}); '
                                 'check data_root')
        self._dataset_meta = dataset_meta

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        for data_sample in data_samples:
            if 'pred_score' not in data_sample:
                raise ValueError('SubsetAccuracy ranks the class scores, but the data sample '
                                 'has no pred_score (only a predicted label)')
            score = data_sample['pred_score']
            if score.ndim != 1 or score.numel() != self.num_classes:
                raise ValueError(f'SubsetAccuracy expects {self.num_classes}-class scores '
                                 f'(a {self.num_classes}-way ImageNet classifier), got '
                                 f'pred_score of shape {tuple(score.shape)}')
            gt_label = data_sample['gt_label'].reshape(-1)
            if gt_label.numel() != 1:
                raise ValueError(f'SubsetAccuracy takes one gt_label per sample, got '
                                 f'{gt_label.tolist()}')
            self.results.append({
                'pred_score': score.detach().cpu()[self._index],
                'gt_label': gt_label.cpu().long(),
            })

    def compute_metrics(self, results: List[dict]) -> Dict[str, float]:
        scores = torch.stack([result['pred_score'] for result in results]).float()
        target = torch.cat([result['gt_label'] for result in results])
        outside = target[(target < 0) | (target >= len(self.class_indices))]
        if outside.numel():
            raise ValueError(f'gt_label must be in 0..{len(self.class_indices) - 1} (the '
                             f'subset labels), got {sorted(set(outside.tolist()))}')
        ranked = scores.topk(max(self.topk), dim=1).indices
        hits = ranked == target[:, None]
        return {f'top{k}': hits[:, :k].any(dim=1).float().mean().item() * 100
                for k in self.topk}
