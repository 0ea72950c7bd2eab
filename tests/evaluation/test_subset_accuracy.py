"""SubsetAccuracy: ImageNet-A/R class lists from timm, the argmax over the subset only, the
label order CustomDataset gives the wnid folders, and the mmengine Evaluator path."""
import importlib.resources

import pytest
import torch
from mmengine.evaluator import Evaluator

from linvit_mm.evaluation import IMAGENET_SUBSETS, SubsetAccuracy, imagenet_subset
from mmpretrain.datasets import CustomDataset
from mmpretrain.registry import METRICS
from mmpretrain.structures import DataSample


def timm_lines(filename):
    path = importlib.resources.files('timm.data').joinpath('_info', filename)
    return path.read_text().split()


def sample(scores, gt_label):
    return DataSample().set_gt_label(gt_label).set_pred_score(scores)


def subset_hit_scores(class_indices, label, decoy):
    """1000-d softmax-like scores: the best overall is ``decoy`` (outside the subset), the
    best inside the subset is ``class_indices[label]``."""
    scores = torch.full((1000, ), 1e-4)
    scores[decoy] = 0.6
    scores[class_indices[label]] = 0.3
    return scores / scores.sum()


def evaluate(metric, samples):
    evaluator = Evaluator(metric)
    evaluator.process(samples)
    return evaluator.evaluate(len(samples))


@pytest.mark.parametrize('subset', IMAGENET_SUBSETS)
def test_subset_matches_timm_files(subset):
    wnids, indices = imagenet_subset(subset)
    stem = subset.replace('-', '_')
    assert len(wnids) == len(indices) == 200
    assert list(wnids) == sorted(wnids)
    shipped = dict(zip(timm_lines(f'{stem}_synsets.txt'),
                       map(int, timm_lines(f'{stem}_indices.txt'))))
    assert dict(zip(wnids, indices)) == shipped
    imagenet = timm_lines('imagenet_synsets.txt')
    assert all(imagenet[index] == wnid for wnid, index in zip(wnids, indices))


def test_subsets_differ():
    a_wnids, _ = imagenet_subset('imagenet-a')
    r_wnids, _ = imagenet_subset('imagenet-r')
    assert a_wnids != r_wnids and 0 < len(set(a_wnids) & set(r_wnids)) < 200


@pytest.mark.parametrize('subset', IMAGENET_SUBSETS)
def test_custom_dataset_labels_match_metric_order(subset, tmp_path):
    # The archive's wnid folders read by CustomDataset: label i must be the metric's class i.
    wnids, indices = imagenet_subset(subset)
    root = tmp_path / subset
    for wnid in reversed(wnids):
        (root / wnid).mkdir(parents=True)
        (root / wnid / f'{wnid}_0.jpg').touch()
    (root / 'README.txt').touch()  # the archives ship one beside the folders
    dataset = CustomDataset(data_root=str(root))
    metric = SubsetAccuracy(subset=subset)
    assert dataset.CLASSES == metric.wnids
    imagenet = timm_lines('imagenet_synsets.txt')
    for i in (0, 57, 199):
        info = dataset.get_data_info(i)
        folder = info['img_path'].split('/')[-2]
        assert imagenet[metric.class_indices[info['gt_label']]] == folder
    metric.dataset_meta = dataset.metainfo  # what the runner does; must be accepted


@pytest.mark.parametrize('subset', IMAGENET_SUBSETS)
def test_argmax_inside_subset_counts(subset):
    metric = SubsetAccuracy(subset=subset, topk=(1, 5))
    indices = metric.class_indices
    outside = sorted(set(range(1000)) - set(indices))
    samples = [
        sample(subset_hit_scores(indices, label=3, decoy=outside[0]), 3),  # right in subset
        sample(subset_hit_scores(indices, label=7, decoy=outside[1]), 7),
        sample(subset_hit_scores(indices, label=150, decoy=outside[2]), 8),  # wrong class
        sample(subset_hit_scores(indices, label=199, decoy=outside[3]), 0),
    ]
    # The decoys beat every subset class, so a full-width argmax would score 0 %.
    assert all(s.pred_score.argmax().item() not in indices for s in samples)
    results = evaluate(metric, samples)
    assert results == {'accuracy/top1': 50.0, 'accuracy/top5': 50.0}


def test_topk_counts_rank_inside_subset():
    indices = [10, 20, 30, 40, 50, 60]
    scores = torch.zeros(1000)
    # Inside the subset the ranking is 60 > 50 > 40 > 30 > 20 > 10; class 0 beats them all.
    scores[0] = 10.0
    for rank, index in enumerate(reversed(indices)):
        scores[index] = 5.0 - rank
    samples = [sample(scores, label) for label in range(6)]  # label 5 (60) is top-1
    results = evaluate(SubsetAccuracy(class_indices=indices, topk=(1, 2, 6)), samples)
    assert results['accuracy/top1'] == pytest.approx(100 / 6)
    assert results['accuracy/top2'] == pytest.approx(200 / 6)
    assert results['accuracy/top6'] == pytest.approx(100.0)


def test_class_indices_order_defines_labels():
    scores = torch.zeros(1000)
    scores[30] = 1.0
    first = evaluate(SubsetAccuracy(class_indices=[10, 30]), [sample(scores, 1)])
    second = evaluate(SubsetAccuracy(class_indices=[30, 10]), [sample(scores, 1)])
    assert first['accuracy/top1'] == 100.0 and second['accuracy/top1'] == 0.0


def test_built_from_registry_with_prefix():
    metric = METRICS.build(dict(type='SubsetAccuracy', subset='imagenet-r',
                                prefix='imagenet-r'))
    assert isinstance(metric, SubsetAccuracy)
    indices = metric.class_indices
    results = evaluate(metric, [sample(subset_hit_scores(indices, 0, decoy=0), 0)])
    assert results == {'imagenet-r/top1': 100.0}


def test_logits_and_softmax_agree():
    torch.manual_seed(0)
    logits = torch.randn(40, 1000, dtype=torch.float64) * 3
    labels = torch.randint(0, 200, (40, ))
    outs = []
    for scores in (logits, logits.softmax(dim=1)):
        outs.append(evaluate(SubsetAccuracy(subset='imagenet-a', topk=(1, 5)),
                             [sample(s, int(y)) for s, y in zip(scores, labels)]))
    assert outs[0] == outs[1]
    # and both equal the argmax over the 200 columns computed by hand
    index = torch.tensor(imagenet_subset('imagenet-a')[1])
    top1 = (logits[:, index].argmax(dim=1) == labels).double().mean().item() * 100
    assert outs[0]['accuracy/top1'] == pytest.approx(top1)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize('width', [200, 1001], ids=['subset-width', 'too-wide'])
def test_wrong_score_width(width):
    metric = SubsetAccuracy(subset='imagenet-a')
    with pytest.raises(ValueError, match=rf'1000-class scores.*\({width},\)'):
        metric.process(None, [{'pred_score': torch.zeros(width), 'gt_label': torch.tensor([0])}])


def test_labels_only_rejected():
    metric = SubsetAccuracy(subset='imagenet-a')
    with pytest.raises(ValueError, match='no pred_score'):
        metric.process(None, [{'pred_label': torch.tensor([0]), 'gt_label': torch.tensor([0])}])


def test_gt_label_outside_subset():
    metric = SubsetAccuracy(class_indices=[1, 2, 3])
    with pytest.raises(ValueError, match=r'0\.\.2'):
        evaluate(metric, [sample(torch.zeros(1000), 3)])


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(), ValueError, 'exactly one'),
    (dict(subset='imagenet-a', class_indices=[1]), ValueError, 'exactly one'),
    (dict(subset='imagenet-c'), ValueError, r"\['imagenet-a', 'imagenet-r'\]"),
    (dict(class_indices=[1, 1]), ValueError, 'repeats'),
    (dict(class_indices=[-1]), ValueError, '>= 0'),
    (dict(class_indices=[1000]), ValueError, 'beyond the 1000'),
    (dict(class_indices='12'), TypeError, 'sequence of ints'),
    (dict(class_indices=[1.0]), ValueError, 'sequence of ints'),
    (dict(subset='imagenet-a', topk=0), ValueError, r'1\.\.200'),
    (dict(class_indices=[1, 2], topk=(1, 5)), ValueError, r'1\.\.2'),
    (dict(subset='imagenet-a', num_classes=0), ValueError, 'positive int'),
], ids=['none', 'both', 'unknown-subset', 'repeat', 'negative', 'too-large', 'string',
        'float', 'topk-zero', 'topk-too-large', 'num-classes'])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        SubsetAccuracy(**kwargs)


def test_wrong_dataset_folders_rejected():
    a_wnids, _ = imagenet_subset('imagenet-a')
    r_wnids, _ = imagenet_subset('imagenet-r')
    metric = SubsetAccuracy(subset='imagenet-a')
    with pytest.raises(ValueError, match='not the imagenet-a classes'):
        metric.dataset_meta = dict(classes=r_wnids)
    with pytest.raises(ValueError, match='has 1000 classes'):
        metric.dataset_meta = dict(classes=[f'c{i}' for i in range(1000)])
    evaluator = Evaluator(SubsetAccuracy(subset='imagenet-r'))
    with pytest.raises(ValueError, match='not the imagenet-r classes'):
        evaluator.dataset_meta = dict(classes=a_wnids)
