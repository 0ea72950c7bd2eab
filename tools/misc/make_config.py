#!/usr/bin/env python
"""Write any config of the grid from its name; check that the configs in the repository are
what it writes.

``configs/`` keeps a config for each row the paper reports and each recipe we recommend
(see the README of each folder). Every other combination of operator, size, setting,
distillation and data set is one command away; the name says what it is::

    python tools/misc/make_config.py linvit-elu-tiny_mimetic-distill_32xb128_in1k
    python tools/misc/make_config.py linvit-ttt-small_fullcopy_8xb64_pets \\
        mask-rcnn_linvit-adapter-mhla-base_fpn_1x_coco --out-dir my_configs

A config goes into its folder under ``configs/`` (bases by relative path) or, with
``--out-dir`` outside ``configs/``, into that folder with ``linvit_mm::`` bases (our tools,
or any process that imported ``linvit_mm``, read those). The names, by folder:

* classification/imagenet: ``linvit-{op}-{size}_{setting}[-distill]_32xb128_in1k``
* classification/transfer: ``linvit-{op}-{size}_{setting}[-distill]_8xb64_{set}``
* classification/robustness: ``linvit-{op}-{size}_32xb128_in1k-{test set}``
* detection: ``mask-rcnn_linvit-adapter-{op}-{size}[_{setting}[-distill]]_fpn_1x_coco``
  (ViT-Adapter) and ``mask-rcnn_linvit-{op}-{size}_plain[_{setting}[-distill]]_fpn_1x_coco``
  (the plain ViT with a simple pyramid, the paper's protocol)
* segmentation: ``upernet_linvit-adapter-{op}-{size}[_{setting}[-distill]]_8xb2-160k_ade20k-512x512``
  and ``upernet_linvit-{op}-{size}_plain[_{setting}[-distill]]_8xb2-160k_ade20k-512x512``

``op`` is any registered attention operator, or ``{op}-hybrid``: that operator with Softmax
attention in the first and last blocks (``attn_type=dict(default=op, softmax=[0, -1])``:
blocks 0 and 11 of the 12 of every size; ``HYBRID_SOFTMAX_BLOCKS``); ``setting`` any setting of
``linvit_mm.transfer`` (Mimetic and Impulse only for operators with a QK^T form); ``size``,
``set`` and ``test set`` whatever has a base in ``configs/`` (a size is a DeiT size,
``small``, or a foundation-model source, ``dinov2-small``, whose bases carry its arch word
and release). A detector or segmenter starts from the ImageNet stage of its operator and
size, ``fullcopy-distill`` (``fullcopy`` for softmax, which has no teacher to learn from),
or the ImageNet stage its name gives (``_mlpcopy``, ``_random-distill``, ...). A plain-ViT
Softmax detector runs 14 x 14 windows in the blocks of ``PLAIN_SOFTMAX_WINDOWS`` (as
ViT-Adapter's plain ViT-B does); every other plain detector and every segmenter is global.

``--check`` compares every config of those folders with what this script writes for its
name and exits with 1 naming each one that differs (the test suite runs it).
"""
import argparse
import difflib
import os.path as osp
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / 'configs'
# Base configs, ``{}`` standing for a field of the name.
SIZE_BASE = '_base_/models/linvit/linvit-{}.py'
IMAGENET_BASE = 'classification/imagenet/_base_/32xb128_in1k.py'
TRANSFER_BASE = 'classification/transfer/_base_/8xb64_{}.py'
ROBUSTNESS_BASE = '_base_/datasets/imagenet_robustness_224.py'
DETECTION_BASE = 'detection/_base_/mask-rcnn_linvit-adapter-{}_fpn_1x_coco.py'
SEGMENTATION_BASE = 'segmentation/_base_/upernet_linvit-adapter-{}_8xb2-160k_ade20k-512x512.py'
DETECTION_PLAIN_BASE = 'detection/_base_/mask-rcnn_linvit-plain-{}_fpn_1x_coco.py'
SEGMENTATION_PLAIN_BASE = 'segmentation/_base_/upernet_linvit-plain-{}_8xb2-160k_ade20k-512x512.py'
# ViT-Adapter's plain ViT-B Mask R-CNN: 14 x 14 windows in 8 of the 12 blocks, global in
# 2, 5, 8, 11 (ViTDet style). A windowed linear detector is the same two arguments given
# to its vit (configs/detection/README.md).
PLAIN_SOFTMAX_WINDOWS = dict(window_size=14, window_block_indexes=[0, 1, 3, 4, 6, 7, 9, 10])
# The epoch tools/train.py's last ImageNet checkpoint is named after (the recipe's 300).
IMAGENET_EPOCHS = 300
_OP = r'(?P<op>[a-z0-9_]+)(?P<hybrid>-hybrid)?'
# The blocks a "-hybrid" config keeps Softmax: the first and the last. Where it matters is
# for tools/analysis_tools/select_hybrid_blocks.py to say per model and data set; the ends
# are the usual choice (the first block's attention mixes raw patch embeddings, the last
# one's feeds the head) and the one that holds for any depth.
HYBRID_SOFTMAX_BLOCKS = (0, -1)
# A size base's name: a DeiT size (small) or a foundation-model source's (dinov2-small).
_SIZE = r'(?P<size>[a-z0-9]+(?:-[a-z0-9]+)*)'
_SETTING = r'(?P<setting>[a-z0-9]+)(?P<distill>-distill)?'
# The ImageNet stage a dense config starts from, when not the default one.
_STAGE = rf'(?:_{_SETTING})?'


class Family:
    """One folder of the grid: how its names read, what its configs say, and for each field
    chosen by a base config, the bases (``{}`` standing for the value) or a function that
    lists the valid values."""

    def __init__(self, folder, pattern, render, choices):
        self.folder = folder
        self.pattern = re.compile(pattern)
        self.render = render
        self._choices = choices

    @property
    def fields_with_choices(self):
        return tuple(self._choices)

    def choices(self, field):
        source = self._choices[field]
        if callable(source):
            return source()
        head, tail = source.split('{}')
        folder, prefix = CONFIGS / osp.dirname(head), osp.basename(head)
        values = {path.name[len(prefix):-len(tail)] for path in folder.glob(f'{prefix}*{tail}')}
        return values - {'classifier'}  # linvit-classifier.py is what the size bases share


def imagenet(p):
    return _classifier([SIZE_BASE.format(p['size']), IMAGENET_BASE], p)


def transfer(p):
    return _classifier([SIZE_BASE.format(p['size']), TRANSFER_BASE.format(p['dataset'])], p,
                       head='num_classes={{_base_.num_classes}}')


def attn_args(p):
    """The backbone's ``attn_type`` argument (and ``with_cls_token`` where a hybrid needs
    it): the operator's name, or the dict of a ``-hybrid``."""
    if not p.get('hybrid'):
        return [f"attn_type='{p['op']}'"]
    # _delete_: the base's attn_type is a name, which a dict cannot be merged into
    args = [f"attn_type=dict(_delete_=True, default='{p['op']}', "
            f"softmax={list(HYBRID_SOFTMAX_BLOCKS)})"]
    from linvit_mm.models.attention import attention_class
    if not attention_class(p['op']).uses_cls_token:
        # the hybrid keeps its operator's pooling; its Softmax blocks see the patch tokens
        args.append('with_cls_token=False')
    return args


def _dict(args, indent):
    """``dict(a, b)`` on one line, or with one argument a line (a hybrid's are long)."""
    if len(', '.join(args)) <= 70:
        return f'dict({", ".join(args)})'
    inner = ' ' * (indent + 4)
    return 'dict(\n' + ',\n'.join(inner + arg for arg in args) + ')'


def _classifier(bases, p, head=None):
    args = attn_args(p) + [f"init_cfg=dict(setting='{p['setting']}')"]
    if head is None and p['setting'] == 'fullcopy':
        head = 'init_cfg={{_base_.fullcopy_head_init}}'  # ImageNet: the DeiT head fits
    if head is None:
        lines = [f'model = dict(backbone={_dict(args, 0)})']
    else:
        lines = ['model = dict(', f'    backbone={_dict(args, 4)},', f'    head=dict({head}))']
    if p['distill']:
        lines.append('custom_hooks = [{{_base_.distill_hook}}]')
    return bases, lines


def robustness(p):
    testset = p['testset']
    return [SIZE_BASE.format(p['size']), IMAGENET_BASE, ROBUSTNESS_BASE], [
        f'model = dict(backbone={_dict(attn_args(p), 0)})',
        f'test_dataloader = dict(dataset={{{{_base_.imagenet_{testset}_dataset}}}})',
        f'test_evaluator = {{{{_base_.imagenet_{testset}_evaluator}}}}',
    ]


def dense(base, windows=None):
    """The render of a dense family on ``base``; ``windows``: the vit arguments of its
    Softmax models (not of hybrids, whose Softmax blocks are the ends)."""

    def render(p):
        stage = imagenet_stage(p['op'], p['size'], p['hybrid'], p.get('setting'),
                               p.get('distill'))
        extra = []
        if windows and p['op'] == 'softmax' and not p.get('hybrid'):
            extra = [f'{key}={value!r}' for key, value in windows.items()]
        return [base.format(p['size'])], [
            '# The ImageNet-stage checkpoint: what tools/train.py writes for',
            f'#   configs/classification/imagenet/{stage}.py',
            f"linvit_checkpoint = 'work_dirs/{stage}/epoch_{IMAGENET_EPOCHS}.pth'",
            *_dense_model(p, extra),
        ]

    return render


def _dense_model(p, extra=()):
    args = attn_args(p) + list(extra)
    if len(args) == 1 and not p.get('hybrid'):
        return [f'model = dict(backbone=dict(vit=dict({args[0]}), pretrained=linvit_checkpoint))']
    return ['model = dict(', '    backbone=dict(', f'        vit={_dict(args, 8)},',
            '        pretrained=linvit_checkpoint))']


def robustness_sets():
    """The test sets of the robustness base (its ``imagenet_<set>_dataset`` variables)."""
    text = (CONFIGS / ROBUSTNESS_BASE).read_text()
    return set(re.findall(r'^imagenet_(\w+)_dataset = ', text, flags=re.M))


FAMILIES = (
    Family('classification/imagenet', rf'linvit-{_OP}-{_SIZE}_{_SETTING}_32xb128_in1k', imagenet,
           {'size': SIZE_BASE}),
    Family('classification/transfer',
           rf'linvit-{_OP}-{_SIZE}_{_SETTING}_8xb64_(?P<dataset>[a-z0-9]+)', transfer,
           {'size': SIZE_BASE, 'dataset': TRANSFER_BASE}),
    Family('classification/robustness',
           rf'linvit-{_OP}-{_SIZE}_32xb128_in1k-(?P<testset>[a-z0-9]+)', robustness,
           {'size': SIZE_BASE, 'testset': robustness_sets}),
    Family('detection', rf'mask-rcnn_linvit-adapter-{_OP}-{_SIZE}{_STAGE}_fpn_1x_coco',
           dense(DETECTION_BASE), {'size': DETECTION_BASE}),
    Family('segmentation',
           rf'upernet_linvit-adapter-{_OP}-{_SIZE}{_STAGE}_8xb2-160k_ade20k-512x512',
           dense(SEGMENTATION_BASE), {'size': SEGMENTATION_BASE}),
    Family('detection', rf'mask-rcnn_linvit-{_OP}-{_SIZE}_plain{_STAGE}_fpn_1x_coco',
           dense(DETECTION_PLAIN_BASE, PLAIN_SOFTMAX_WINDOWS), {'size': DETECTION_PLAIN_BASE}),
    Family('segmentation',
           rf'upernet_linvit-{_OP}-{_SIZE}_plain{_STAGE}_8xb2-160k_ade20k-512x512',
           dense(SEGMENTATION_PLAIN_BASE), {'size': SEGMENTATION_PLAIN_BASE}),
)


def imagenet_stage(op, size, hybrid=None, setting=None, distill=None):
    """The ImageNet config whose checkpoint a detector or segmenter of ``op`` (``hybrid``:
    ``'-hybrid'`` or None) starts from: ``setting`` (``distill``: ``'-distill'`` or None),
    by default FullCopy with distillation (without for softmax)."""
    if setting is None:
        setting = 'fullcopy' if op == 'softmax' else 'fullcopy-distill'
    else:
        setting += distill or ''
    return f'linvit-{op}{hybrid or ""}-{size}_{setting}_32xb128_in1k'


def parse(name):
    """``(family, fields, stem)`` of a config name (a file name or path is accepted too)."""
    stem = osp.basename(str(name)).removesuffix('.py')
    for family in FAMILIES:
        match = family.pattern.fullmatch(stem)
        if match:
            return family, match.groupdict(), stem
    raise ValueError(f'{stem!r} is not a name of the config grid; names read:\n' +
                     '\n'.join(f'  {f.pattern.pattern}  ({f.folder})' for f in FAMILIES))


def check_fields(family, fields):
    """Refuse, naming the field and the valid values, what the grid cannot build."""
    from linvit_mm.models.attention import attention_class, attention_types
    from linvit_mm.transfer.settings import resolve_setting
    op = fields['op']
    if op not in attention_types():
        raise ValueError(f'unknown attention operator {op!r}; registered operators: '
                         f'{", ".join(attention_types())}')
    if fields.get('hybrid') and op == 'softmax':
        raise ValueError('softmax-hybrid: a hybrid keeps Softmax in blocks '
                         f'{list(HYBRID_SOFTMAX_BLOCKS)} of a model of another operator; name '
                         'that operator (e.g. linvit-relu-hybrid-...)')
    for field in family.fields_with_choices:
        valid = family.choices(field)
        if fields[field] not in valid:
            raise ValueError(f'no {field} {fields[field]!r} in configs/ for {family.folder}; '
                             f'valid: {", ".join(sorted(valid))}')
    if fields.get('setting') is not None:
        _, _, analytic = resolve_setting(fields['setting'])
        operator = attention_class(op)
        if analytic is not None and not operator.has_qk_form:
            raise ValueError(f'the {analytic} setting is not defined for the {op!r} operator: '
                             f'{operator.qk_form_absent_because}')


def render(name, out_dir=None):
    """``(path, text)`` of the config ``name`` in ``out_dir`` (default: its folder)."""
    family, fields, stem = parse(name)
    check_fields(family, fields)
    out_dir = Path(out_dir).resolve() if out_dir is not None else CONFIGS / family.folder
    bases, lines = family.render(fields)
    bases = [_base_path(base, out_dir) for base in bases]
    if len(bases) == 1:
        head = [f"_base_ = '{bases[0]}'"]
    else:
        head = ['_base_ = ['] + [f"    '{base}'," for base in bases] + [']']
    return out_dir / f'{stem}.py', '\n'.join(head + [''] + lines) + '\n'


def _base_path(base, out_dir):
    if out_dir == CONFIGS or CONFIGS in out_dir.parents:
        relative = osp.relpath(CONFIGS / base, out_dir)
        return relative if relative.startswith('.') else f'./{relative}'
    return f'linvit_mm::{base}'


def grid_configs():
    """The configs in the repository that this script writes (every file of its folders)."""
    return sorted({path for family in FAMILIES for path in (CONFIGS / family.folder).glob('*.py')})


def check(paths=None):
    """What is wrong with each config (default: :func:`grid_configs`) that is not what
    :func:`render` writes for its name, in its folder."""
    problems = []
    for path in grid_configs() if paths is None else paths:
        shown = path.relative_to(REPO) if REPO in path.parents else path
        try:
            expected_path, text = render(path.name)
        except ValueError as err:
            problems.append(f'{shown}: {err}')
            continue
        if CONFIGS in path.parents and expected_path != path:
            problems.append(f'{shown}: belongs in {expected_path.relative_to(REPO)}')
        elif path.read_text() != text:
            diff = difflib.unified_diff(path.read_text().splitlines(), text.splitlines(),
                                        'in the repository', 'written by make_config.py',
                                        lineterm='')
            problems.append(f'{shown} differs:\n' + '\n'.join(diff))
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('names', nargs='*', metavar='NAME', help='config names (see above)')
    parser.add_argument('--out-dir', help='write here instead of the folder under configs/')
    parser.add_argument('--force', action='store_true',
                        help='overwrite a config that exists with other contents')
    parser.add_argument('--check', action='store_true',
                        help='check that the configs in the repository are what it writes')
    args = parser.parse_args(argv)
    if args.check == bool(args.names):
        parser.error('give config names or --check')
    if args.check:
        problems = check()
        for problem in problems:
            print(problem)
        print(f'{len(grid_configs()) - len(problems)} configs are what make_config.py writes, '
              f'{len(problems)} are not')
        return 1 if problems else 0
    try:
        outputs = [render(name, args.out_dir) for name in args.names]
    except ValueError as err:
        parser.error(str(err))
    for path, text in outputs:
        if path.exists() and path.read_text() != text and not args.force:
            parser.error(f'{path} exists with other contents; --force overwrites it')
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == '__main__':
    sys.exit(main())
