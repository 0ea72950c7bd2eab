"""model-index.yml and the metafiles of configs/: what mim and mmengine read about the models.

Every config of a folder with a metafile is listed there once, under its own name; the
results are the paper's numbers of README.md's "What the paper reports" and nothing else;
the parameter counts are those of the models the configs build.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from mmengine.config import Config
from mmengine.registry import DefaultScope, init_default_scope

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / 'model-index.yml'
METAFILES = sorted(str(p.relative_to(REPO)) for p in (REPO / 'configs').rglob('metafile.yml'))


def metafile(path):
    return yaml.safe_load((REPO / path).read_text())


def all_models():
    return [model for path in METAFILES for model in metafile(path)['Models']]


def test_model_index_imports_every_metafile():
    assert METAFILES, 'no metafile.yml under configs/'
    assert sorted(yaml.safe_load(INDEX.read_text())['Import']) == METAFILES


def test_model_index_loads_with_the_model_index_package_mim_uses():
    from modelindex.load_model_index import load
    index = load(str(INDEX))
    index.build_models_with_collections()
    collections = {collection.name for collection in index.collections}
    assert len(index.models) == len(all_models())
    for model in index.models:
        assert model.in_collection in collections, model.name
        assert (REPO / model.config).is_file(), model.config


@pytest.mark.parametrize('path', METAFILES)
def test_metafile_lists_every_config_of_its_folder_once(path):
    folder = (REPO / path).parent
    data = metafile(path)
    names = [model['Name'] for model in data['Models']]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(p.stem for p in folder.glob('*.py'))
    collections = {collection['Name'] for collection in data['Collections']}
    for model in data['Models']:
        assert model['Config'] == f'{folder.relative_to(REPO)}/{model["Name"]}.py'
        assert model['In Collection'] in collections
        assert 'Weights' not in model  # none released yet
    for collection in data['Collections']:
        assert (REPO / collection['README']).is_file()
        assert collection['Paper']['URL'] == 'https://arxiv.org/abs/2609.35745'


@pytest.mark.parametrize('path', METAFILES)
def test_folder_readme_lists_every_model(path):
    readme = ((REPO / path).parent / 'README.md').read_text()
    missing = [model['Name'] for model in metafile(path)['Models']
               if f'[{model["Name"]}]({model["Name"]}.py)' not in readme]
    assert not missing


def paper_results_in_readme():
    """``{(config name, metric): value}`` from README.md's "What the paper reports"."""
    text = (REPO / 'README.md').read_text()
    section = text[text.index('## What the paper reports'):]
    section = section[:section.index('\n## ', 1)]
    rows = [[cell.strip() for cell in line.strip('|').split('|')]
            for line in section.splitlines() if line.startswith('|') and '---' not in line]
    results = {}
    for label, *values in rows:  # header rows match neither form below
        words = label.split()
        op = words[0].lower()
        dense = re.fullmatch(r'([\d.]+) / ([\d.]+)', values[0])
        if dense:  # COCO box / mask AP, ADE20K mIoU
            box, mask = (float(v) for v in dense.groups())
            # Tables D and E: Base, the plain-ViT baseline of ViT-Adapter
            detector = f'mask-rcnn_linvit-{op}-base_plain_fpn_1x_coco'
            segmenter = f'upernet_linvit-{op}-base_plain_8xb2-160k_ade20k-512x512'
            results.update({(detector, 'box AP'): box, (detector, 'mask AP'): mask,
                            (segmenter, 'mIoU'): float(values[1])})
        elif re.fullmatch(r'[\d.]+', values[0]):  # ImageNet top-1, w/o and w/ distill
            setting = words[1].lower() if len(words) > 1 else 'fullcopy'  # Softmax: DeiT-B
            for distill, value in zip(('', '-distill'), values):
                if value:
                    name = f'linvit-{op}-base_{setting}{distill}_32xb128_in1k'
                    results[(name, 'Top 1 Accuracy')] = float(value)
    return results


def test_results_are_the_numbers_the_paper_reports():
    expected = paper_results_in_readme()
    assert len(expected) == 17 + 9  # ImageNet rows; COCO and ADE20K rows
    listed = {(model['Name'], metric): value for model in all_models()
              for result in model.get('Results', []) for metric, value in result['Metrics'].items()}
    assert listed == expected
    for model in all_models():
        assert ('Results' in model) == ('Results From' in model['Metadata']), model['Name']


def count_parameters(config):
    cfg = Config.fromfile(str(REPO / config))
    scope = cfg.get('default_scope', 'mmpretrain')
    init_default_scope(scope)
    registry = {'mmpretrain': 'mmpretrain.registry', 'mmdet': 'mmdet.registry',
                'mmseg': 'mmseg.registry'}[scope]
    models = __import__(registry, fromlist=['MODELS']).MODELS
    with DefaultScope.overwrite_default_scope(scope):
        try:  # no memory, no initialisation: only the shapes count
            with torch.device('meta'):
                model = models.build(cfg.model)
        except RuntimeError:  # an __init__ that reads a value (MHLA's mixing matrix)
            model = models.build(cfg.model)
    return sum(p.numel() for p in model.parameters())


def smallest_model_per_operator(path, per_operator):
    chosen = {}
    for model in metafile(path)['Models']:
        key = model['Metadata']['Attention'] if per_operator else None
        if key not in chosen or model['Metadata']['Parameters'] < \
                chosen[key]['Metadata']['Parameters']:
            chosen[key] = model
    return list(chosen.values())


@pytest.mark.parametrize('path', METAFILES)
def test_parameter_counts_are_those_of_the_built_models(path):
    """The smallest model of each operator (classification) or of the folder (dense): the
    counts depend on the architecture only, which these cover."""
    for model in smallest_model_per_operator(path, per_operator='classification' in path):
        assert count_parameters(model['Config']) == model['Metadata']['Parameters'], \
            model['Name']


def test_mim_search_lists_every_model():
    result = subprocess.run([sys.executable, '-m', 'mim', 'search', 'linvit_mm',
                             '--valid-config'], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    listed = set(re.findall(r"'([^']+)'", result.stdout))
    assert listed == {model['Name'] for model in all_models()}
