"""Every config under configs/, and every override pattern the README documents, loads,
builds with a tiny backbone, initialises and runs.

The real recipes are kept (heads, necks, data preprocessors, optimizer wrappers, hooks,
dataset/transform/metric types); only the backbone is shrunk and the checkpoints are
replaced by tiny ones written here, so no config can rot unnoticed.
"""
import argparse
import collections
import copy
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from mmengine.config import Config, DictAction
from mmengine.optim import build_optim_wrapper
from mmengine.registry import DefaultScope, init_default_scope

REPO = Path(__file__).resolve().parents[2]
CONFIG_ROOT = REPO / 'configs'
CONFIGS = sorted(p for p in CONFIG_ROOT.rglob('*.py') if '_base_' not in p.parts)
README = (REPO / 'README.md').read_text()
TINY_ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
# Four blocks: the segmentation adapter adds interaction i's output to level i.
DENSE_ARCH = dict(TINY_ARCH, num_layers=4)
IMG = 32  # classification input side; two 16-pixel patches a side
# The timm model of each foundation-model source a kept config copies from; its tiny
# checkpoint keeps every switch of the family (patch size, registers, RoPE, LayerScale).
SOURCE_TIMM_MODELS = {
    'dinov2-small': 'vit_small_patch14_dinov2',
    'dinov2-base': 'vit_base_patch14_dinov2',
    'dinov2-large': 'vit_large_patch14_dinov2',
    'dinov3-small': 'vit_small_patch16_dinov3',
    'dinov3-base': 'vit_base_patch16_dinov3',
}


def source_word(vit):
    """The arch word of a foundation-model source that ``vit`` names, else None."""
    from linvit_mm.models import LinearViT
    from linvit_mm.models.backbones.linear_vit import ARCH_ESSENTIALS
    arch = vit.get('arch')
    if isinstance(arch, str) and set(LinearViT.arch_zoo.get(arch, {})) - set(ARCH_ESSENTIALS):
        return arch
    return None


def shrink_vit(vit, sizes, patch_size=None):
    """Test sizes for a LinearViT config; a source's arch word keeps its switches (its
    patch size included), another ViT gets ``patch_size`` where one is given."""
    from linvit_mm.models import LinearViT
    word = source_word(vit)
    if word is None:
        vit.update(arch=dict(sizes))
        if patch_size is not None:
            vit.update(patch_size=patch_size)
    else:
        vit.update(arch=dict(LinearViT.arch_zoo[word], **sizes), patch_size=None)
    return word


def source_checkpoint(word, folder):
    """A tiny timm checkpoint of ``word``'s family at TINY_ARCH's sizes (written once)."""
    import timm
    path = Path(folder) / f'{word}_for_configs.pth'
    if not path.exists():
        torch.manual_seed(0)
        model = timm.create_model(SOURCE_TIMM_MODELS[word], pretrained=False, img_size=IMG,
                                  num_classes=0, embed_dim=TINY_ARCH['embed_dims'],
                                  depth=TINY_ARCH['num_layers'],
                                  num_heads=TINY_ARCH['num_heads'], mlp_ratio=2)
        torch.save(model.state_dict(), path)
    return str(path)


@functools.cache
def loaded_config(path):
    return Config.fromfile(path)


def load_config(path):
    """``Config.fromfile(path)``, a fresh copy of what the file's first load resolved to."""
    return copy.deepcopy(loaded_config(str(path)))


def config_id(path):
    return str(path.relative_to(CONFIG_ROOT))


@pytest.fixture(scope='module')
def softmax_checkpoint(tmp_path_factory):
    """A tiny DeiT in the official release layout (``{'model': timm state dict}``)."""
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    deit = VisionTransformer(img_size=IMG, patch_size=16, embed_dim=32, depth=2, num_heads=2,
                             mlp_ratio=2, num_classes=1000)
    path = tmp_path_factory.mktemp('deit') / 'deit_tiny_for_configs.pth'
    torch.save({'model': deit.state_dict()}, path)
    return str(path)


@pytest.fixture(scope='module')
def classification_checkpoints(tmp_path_factory):
    """Per operator (or hybrid), a tiny classification-stage checkpoint (``backbone.``
    prefix)."""
    from linvit_mm.models import LinearViT
    root = tmp_path_factory.mktemp('cls_stage')
    paths = {}

    def get(attn_type, patch_size, with_cls_token=None, arch=DENSE_ARCH):
        # a hybrid's attn_type and a source's arch are dicts
        key = repr(attn_type), patch_size, with_cls_token, repr(arch)
        if key not in paths:
            vit = LinearViT(arch=arch, attn_type=attn_type, img_size=224,
                            patch_size=patch_size, with_cls_token=with_cls_token)
            vit.init_weights()
            state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
            state['head.layers.head.weight'] = torch.zeros(1000, 32)
            paths[key] = str(root / f'checkpoint_{len(paths)}.pth')
            torch.save({'state_dict': state, 'meta': {}}, paths[key])
        return paths[key]

    return get


@pytest.fixture(scope='module')
def staged_checkpoints(tmp_path_factory):
    """Per operator, a tiny checkpoint of the staged recipe's alignment stages (``backbone.``
    prefix, with the operator record that ``LinearViTCheckpoint`` checks)."""
    from linvit_mm.models import LinearViT
    from linvit_mm.testing.staged import write_recorded_checkpoint
    root = tmp_path_factory.mktemp('staged_stage')
    paths = {}

    def get(attn_type):
        if attn_type not in paths:
            vit = LinearViT(arch=TINY_ARCH, attn_type=attn_type, img_size=IMG, patch_size=16)
            paths[attn_type] = str(write_recorded_checkpoint(root / f'{attn_type}.pth', vit))
        return paths[attn_type]

    return get


def retarget_staged(vit, staged_checkpoints):
    if vit.get('init_cfg', {}).get('type') == 'LinearViTCheckpoint':
        vit.init_cfg.checkpoint = staged_checkpoints(vit.attn_type)


def retarget_transfer(init_cfg, checkpoint):
    cfgs = init_cfg if isinstance(init_cfg, list) else [init_cfg]
    for cfg in cfgs:
        if cfg.get('type') == 'SoftmaxTransfer' and cfg.get('checkpoint'):
            cfg['checkpoint'] = checkpoint


def resolves(registry, scope, type_name):
    with registry.switch_scope_and_registry(scope) as scoped:
        return scoped.get(type_name) is not None


def check_registered(cfg, scope):
    """Types named by the data, evaluation and hook parts resolve in their registries."""
    from mmengine.registry import DATASETS, HOOKS, METRICS, TRANSFORMS
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        if cfg.get(loader) is None:  # the staged recipe's aligners validate nothing
            continue
        dataset = cfg[loader]['dataset']
        assert resolves(DATASETS, scope, dataset['type']), dataset['type']
        for transform in dataset.get('pipeline', []):
            assert resolves(TRANSFORMS, scope, transform['type']), transform['type']
    for key in ('val_evaluator', 'test_evaluator'):
        if cfg.get(key) is None:
            continue
        evaluators = cfg[key] if isinstance(cfg[key], list) else [cfg[key]]
        for evaluator in evaluators:
            assert resolves(METRICS, scope, evaluator['type']), evaluator['type']
    for hook in cfg.get('custom_hooks', []):
        HOOKS.build(hook)


def prepare_classification(cfg, softmax_checkpoint, staged_checkpoints=None):
    """Shrink ``cfg`` to the test's sizes in place; returns the source's arch word (or None)."""
    backbone = cfg.model.backbone
    vit = backbone.module if backbone.type == 'LoRAModel' else backbone
    vit.update(img_size=IMG)
    word = shrink_vit(vit, TINY_ARCH, patch_size=16)
    if word is not None:  # copied from a tiny checkpoint of the source's family
        softmax_checkpoint = source_checkpoint(word, Path(softmax_checkpoint).parent)
    retarget_transfer(vit.get('init_cfg') or [], softmax_checkpoint)
    retarget_staged(vit, staged_checkpoints)
    cfg.model.head.in_channels = TINY_ARCH['embed_dims']
    if cfg.model.head.get('init_cfg'):
        retarget_transfer(cfg.model.head.init_cfg, softmax_checkpoint)
    for hook in cfg.get('custom_hooks', []):
        if hook['type'] == 'AttentionDistillHook':
            teacher_cfg = hook['teacher']
            teacher_cfg.update(img_size=IMG)
            assert shrink_vit(teacher_cfg, TINY_ARCH, patch_size=16) == word  # same source
            retarget_transfer(teacher_cfg.init_cfg, softmax_checkpoint)
    return word


def run_classification(cfg, word):
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    model = MODELS.build(cfg.model)
    model.init_weights()
    if word is not None:
        from linvit_mm.models import LinearViT
        assert model.backbone.patch_size == LinearViT.arch_zoo[word]['patch_size']
        assert model.backbone.transfer_report['copied']  # from the source's checkpoint
    if cfg.model.backbone.type == 'LoRAModel':  # mmpretrain's LoRA around the LinearViT
        from linvit_mm.staged import unmatched_lora_targets
        assert not unmatched_lora_targets(model.backbone)
    num_classes = cfg.model.head.num_classes
    samples = [DataSample().set_gt_label(i % num_classes) for i in range(2)]
    data = dict(inputs=[torch.randint(0, 256, (3, IMG, IMG), dtype=torch.uint8)
                        for _ in range(2)], data_samples=samples)
    data = model.data_preprocessor(data, training=True)
    losses = model(**data, mode='loss')
    assert torch.isfinite(sum(v for k, v in losses.items() if 'loss' in k))
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(data, training=False), mode='predict')
    assert preds[0].pred_score.shape == (num_classes, )
    for hook in cfg.get('custom_hooks', []):
        if hook['type'] == 'AttentionDistillHook':
            teacher = MODELS.build(hook['teacher'])
            teacher.init_weights()
    return model


def prepare_aligner(cfg, softmax_checkpoint, staged_checkpoints):
    for vit in (cfg.model.backbone, cfg.model.teacher):
        vit.update(arch=TINY_ARCH, img_size=IMG, patch_size=16)
        retarget_transfer(vit.get('init_cfg') or [], softmax_checkpoint)
    retarget_staged(cfg.model.backbone, staged_checkpoints)
    # as the Runner does: the aligners refuse to train without the teacher's preprocessing
    cfg.model.setdefault('data_preprocessor', cfg.get('data_preprocessor'))


def run_aligner(cfg):
    """The staged recipe's alignment stages: two training steps with the config's optimizer."""
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    model = MODELS.build(cfg.model)
    model.init_weights()
    optim_wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    data = dict(inputs=[torch.randint(0, 256, (3, IMG, IMG), dtype=torch.uint8)
                        for _ in range(2)], data_samples=[DataSample() for _ in range(2)])
    for _ in range(2):
        log_vars = model.train_step(data, optim_wrapper)
        assert any(key.startswith(('loss_align', 'loss_feat')) for key in log_vars)
        assert all(torch.isfinite(torch.as_tensor(value)) for value in log_vars.values())
    return model


def shrink_adapter(cfg, checkpoint):
    backbone = cfg.model.backbone
    shrink_vit(backbone.vit, DENSE_ARCH)
    if backbone.type.endswith('LinearViTPlainPyramid'):
        # of the recipe's windowed blocks, those the shrunk ViT has
        windowed = backbone.vit.get('window_block_indexes')
        if windowed is not None:
            backbone.vit.window_block_indexes = [i for i in windowed
                                                 if i < DENSE_ARCH['num_layers']]
        backbone.update(pretrained=checkpoint)
        return
    backbone.update(interaction_indexes=[[0, 0], [1, 1], [2, 2], [3, 3]], deform_num_heads=2,
                    deform_ratio=1.0, conv_inplane=8, pretrained=checkpoint)


def prepare_detection(cfg, checkpoint):
    shrink_adapter(cfg, checkpoint)
    cfg.model.neck.in_channels = [TINY_ARCH['embed_dims']] * 4
    # Mask R-CNN's proposal and sample counts are mmdet's, not the config's subject: a
    # thousand RoIs through the 1024-wide box head and a hundred through the mask head took
    # most of each run's time
    model = cfg.model
    model.train_cfg.rpn_proposal.update(nms_pre=200, max_per_img=50)
    model.train_cfg.rcnn.sampler.num = 32
    model.test_cfg.rpn.update(nms_pre=200, max_per_img=50)
    model.test_cfg.rcnn.max_per_img = 5


def run_detection(cfg):
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData
    model = MODELS.build(cfg.model)
    model.init_weights()
    h, w = 75, 100  # non-square, not multiples of 32
    masks = np.zeros((1, h, w), dtype=np.uint8)
    masks[0, 10:40, 20:60] = 1
    sample = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w),
                                         scale_factor=(1., 1.)))
    sample.gt_instances = InstanceData(bboxes=torch.tensor([[20., 10., 60., 40.]]),
                                       labels=torch.tensor([3]), masks=BitmapMasks(masks, h, w))
    data = dict(inputs=[torch.randint(0, 256, (3, h, w), dtype=torch.uint8)],
                data_samples=[sample])
    losses = model(**model.data_preprocessor(data, training=True), mode='loss')
    total = sum(v if torch.is_tensor(v) else sum(v) for k, v in losses.items() if 'loss' in k)
    assert torch.isfinite(total)
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(data, training=False), mode='predict')
    assert preds[0].pred_instances.bboxes.shape[-1] == 4
    return model


def prepare_segmentation(cfg, checkpoint):
    shrink_adapter(cfg, checkpoint)
    width = TINY_ARCH['embed_dims']
    cfg.model.decode_head.in_channels = [width] * 4
    cfg.model.auxiliary_head.in_channels = width
    # UperNet's own 512-channel convolutions are mmseg's, not the config's subject, and took
    # most of each run's time
    cfg.model.decode_head.channels = width
    cfg.model.auxiliary_head.channels = width
    # the test's images are 96 x 128 (a config may pad to a multiple instead of a size)
    cfg.model.data_preprocessor.update(size=(96, 128), size_divisor=None)


def run_segmentation(cfg):
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    model = MODELS.build(cfg.model)
    model.init_weights()
    h, w = 75, 100
    samples = []
    for _ in range(2):  # UperNet's pooling branch has BN on 1x1 maps: needs 2 images
        sample = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w)))
        sample.gt_sem_seg = PixelData(
            data=torch.randint(0, cfg.model.decode_head.num_classes, (1, h, w)))
        samples.append(sample)
    data = dict(inputs=[torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for _ in samples],
                data_samples=samples)
    losses = model(**model.data_preprocessor(data, training=True), mode='loss')
    assert torch.isfinite(sum(v for k, v in losses.items() if 'loss' in k))
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(data, training=False), mode='predict')
    assert preds[0].pred_sem_seg.data.shape == (1, h, w)
    return model


def test_every_operator_and_size_has_its_imagenet_recipe():
    """The ImageNet stage that a detector or segmenter of each operator and DeiT size starts
    from, and that of every kept detector and segmenter (the foundation-model sources keep
    relu and ttt), is a config of the repository (others: tools/misc/make_config.py)."""
    from linvit_mm.models.attention import attention_types
    bases = [p for p in (CONFIG_ROOT / '_base_/models/linvit').glob('linvit-*.py')
             if p.stem != 'linvit-classifier']
    sizes = [p.stem[len('linvit-'):] for p in bases
             if source_word(load_config(p).model.backbone) is None]
    assert {'tiny', 'small', 'base'} <= set(sizes)
    setting = {'softmax': 'fullcopy'}
    missing = [f'linvit-{op}-{size}_{setting.get(op, "fullcopy-distill")}_32xb128_in1k.py'
               for op in attention_types() for size in sizes]
    for dense in ('detection', 'segmentation'):
        for config in (CONFIG_ROOT / dense).glob('*.py'):
            stage = load_config(config).linvit_checkpoint.split('/')[1]
            missing.append(f'{stage}.py')
    missing = [name for name in missing
               if not (CONFIG_ROOT / 'classification/imagenet' / name).is_file()]
    assert not missing, (f'no ImageNet config for {missing}: write them with '
                         f'tools/misc/make_config.py')


@pytest.mark.parametrize('config', CONFIGS, ids=config_id)
def test_config_builds_and_runs(config, softmax_checkpoint, classification_checkpoints,
                                staged_checkpoints):
    build_and_run(load_config(config), softmax_checkpoint, classification_checkpoints,
                  staged_checkpoints)


# What a run of a prepared config reads, by kind of model: a run gets a Config of these keys
# only, so two configs that agree on them run the same and the run is done once for both.
RUN_KEYS = {'aligner': ('model', 'optim_wrapper'), 'classification': ('model', 'custom_hooks'),
            'detection': ('model', ), 'segmentation': ('model', )}
RUNS = {'aligner': run_aligner, 'classification': run_classification,
        'detection': run_detection, 'segmentation': run_segmentation}
# Models of the latest distinct runs: the configs that share one (sizes of an operator that
# the test's tiny arch makes alike, data sets and schedules of one recipe) sort close together.
RECENT_RUNS = collections.OrderedDict()
KEPT_RUNS = 6


def prepare(cfg, softmax_checkpoint, classification_checkpoints, staged_checkpoints):
    """Shrink ``cfg`` in place; returns the kind of model and the arguments of its run."""
    scope = cfg.get('default_scope', 'mmpretrain')
    if cfg.model.type in ('AttentionAligner', 'FeatureAligner'):
        prepare_aligner(cfg, softmax_checkpoint, staged_checkpoints)
        return 'aligner', {}
    if scope == 'mmpretrain':
        word = prepare_classification(cfg, softmax_checkpoint, staged_checkpoints)
        return 'classification', dict(word=word)
    vit = cfg.model.backbone.vit
    # the demo's mini ViT uses 8-pixel patches; the checkpoint must match the model
    checkpoint = classification_checkpoints(vit.attn_type, vit.get('patch_size', 16),
                                            vit.get('with_cls_token'))
    if source_word(vit) is not None:  # the source's switches, at the test's sizes
        shrunk = dict(vit)
        shrink_vit(shrunk, DENSE_ARCH)
        checkpoint = classification_checkpoints(vit.attn_type, None, vit.get('with_cls_token'),
                                                arch=shrunk['arch'])
    kind = 'detection' if scope == 'mmdet' else 'segmentation'
    (prepare_detection if kind == 'detection' else prepare_segmentation)(cfg, checkpoint)
    return kind, {}


def build_and_run(cfg, softmax_checkpoint, classification_checkpoints, staged_checkpoints=None):
    scope = cfg.get('default_scope', 'mmpretrain')
    init_default_scope(scope)
    with DefaultScope.overwrite_default_scope(scope):
        check_registered(cfg, scope)
        kind, extra = prepare(cfg, softmax_checkpoint, classification_checkpoints,
                              staged_checkpoints)
        run_cfg = Config({key: cfg[key] for key in RUN_KEYS[kind] if key in cfg})
        key = (scope, kind, repr(sorted(extra.items())), repr(run_cfg.to_dict()))
        if key not in RECENT_RUNS:
            RECENT_RUNS[key] = RUNS[kind](run_cfg, **extra)
            while len(RECENT_RUNS) > KEPT_RUNS:
                RECENT_RUNS.popitem(last=False)
        RECENT_RUNS.move_to_end(key)
        model = RECENT_RUNS[key]
        build_optim_wrapper(model, cfg.optim_wrapper)
        return model


# The override patterns of README.md's Configs section, as typed after --cfg-options (PATH
# stands for a file), each applied to one config that the pattern is documented for.
IMAGENET = 'classification/imagenet'
OVERRIDES = {
    'setting': (f'{IMAGENET}/linvit-relu-base_random-distill_32xb128_in1k.py',
                'model.backbone.init_cfg.setting=mlpcopy'),
    'setting from fullcopy': (f'{IMAGENET}/linvit-elu-tiny_fullcopy-distill_32xb128_in1k.py',
                              'model.backbone.init_cfg.setting=copy '
                              'model.head.init_cfg.1.setting=copy'),
    'no distillation': (f'{IMAGENET}/linvit-ttt-base_mlpcopy-distill_32xb128_in1k.py',
                        'custom_hooks=[]'),
    'operator': ('classification/transfer/linvit-relu-small_mlpcopy-distill_8xb64_pets.py',
                 'model.backbone.attn_type=inline'),
    'dense operator': ('detection/mask-rcnn_linvit-adapter-relu-small_fpn_1x_coco.py',
                       'model.backbone.vit.attn_type=mhla model.backbone.pretrained=PATH'),
    'softmax checkpoint': (f'{IMAGENET}/linvit-relu-small_fullcopy-distill_32xb128_in1k.py',
                           'model.backbone.init_cfg.checkpoint=PATH '
                           'custom_hooks.0.teacher.init_cfg.checkpoint=PATH '
                           'model.head.init_cfg.1.checkpoint=PATH'),
    'hybrid': (f'{IMAGENET}/linvit-relu-hybrid-tiny_fullcopy-distill_32xb128_in1k.py',
               'model.backbone.attn_type.default=elu model.backbone.attn_type.softmax=[-1]'),
}


def apply_cli_options(cfg, options):
    """Merge ``options`` exactly as the tools' ``--cfg-options`` would."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    cfg.merge_from_dict(parser.parse_args(['--cfg-options', *options.split()]).cfg_options)
    return cfg


@pytest.mark.parametrize('pattern', OVERRIDES)
def test_readme_documents_the_override_pattern(pattern):
    assert OVERRIDES[pattern][1] in README


@pytest.mark.parametrize('pattern', OVERRIDES)
def test_override_pattern_builds_and_runs(pattern, softmax_checkpoint,
                                          classification_checkpoints):
    config, options = OVERRIDES[pattern]
    path = classification_checkpoints('mhla', 16) if pattern == 'dense operator' else \
        softmax_checkpoint
    cfg = apply_cli_options(load_config(CONFIG_ROOT / config),
                            options.replace('PATH', path))
    if pattern == 'softmax checkpoint':
        assert (cfg.model.backbone.init_cfg.checkpoint ==
                cfg.custom_hooks[0].teacher.init_cfg.checkpoint ==
                cfg.model.head.init_cfg[1].checkpoint == path)
    model = build_and_run(cfg, softmax_checkpoint, classification_checkpoints)
    if pattern == 'setting':
        assert model.backbone.transfer_report['setting'] == 'mlpcopy'
    elif pattern == 'setting from fullcopy':
        assert model.backbone.transfer_report['setting'] == 'copy'
        assert model.head.transfer_report['setting'] == 'copy'
        assert not model.head.layers.head.weight.any()  # not copied: the zero default
    elif pattern == 'no distillation':
        assert cfg.custom_hooks == []
    elif pattern == 'operator':
        assert {layer.attn.attn_type for layer in model.backbone.layers} == {'inline'}
    elif pattern == 'dense operator':
        assert {layer.attn.attn_type for layer in model.backbone.vit.layers} == {'mhla'}
    elif pattern == 'hybrid':  # on the two blocks the test builds
        assert model.backbone.attn_types == ['elu', 'softmax']
    else:
        deit = torch.load(softmax_checkpoint, weights_only=True)['model']
        torch.testing.assert_close(model.head.layers.head.weight, deit['head.weight'])


# Combinations that have no file, written by tools/misc/make_config.py outside the repository
# (so with linvit_mm:: bases): one per folder, and those no override reaches.
WRITTEN = ['linvit-softmax-base_random-distill_32xb128_in1k',  # Softmax with a teacher
           'linvit-elu-tiny_mimetic_32xb128_in1k',
           'linvit-hedgehog-tiny_impulse-distill_32xb128_in1k',
           'linvit-ttt-tiny_fullcopy-distill_8xb64_cifar10',
           'linvit-mhla-base_32xb128_in1k-sketch',
           'mask-rcnn_linvit-adapter-inline-tiny_fpn_1x_coco',
           'upernet_linvit-adapter-elu-base_8xb2-160k_ade20k-512x512',
           # hedgehog and the hybrid on COCO and ADE20K (their ImageNet stages are kept)
           'mask-rcnn_linvit-adapter-hedgehog-small_fpn_1x_coco',
           'upernet_linvit-adapter-hedgehog-tiny_8xb2-160k_ade20k-512x512',
           'mask-rcnn_linvit-adapter-relu-hybrid-tiny_fpn_1x_coco',
           'upernet_linvit-adapter-relu-hybrid-base_8xb2-160k_ade20k-512x512',
           # a hybrid whose operator has no class token (pooled, Softmax on the patches)
           'upernet_linvit-adapter-ttt-hybrid-small_8xb2-160k_ade20k-512x512',
           # foundation-model sources: another operator and data set, a hybrid detector
           'linvit-mhla-dinov2-small_mlpcopy-distill_8xb64_pets',
           'mask-rcnn_linvit-adapter-relu-hybrid-dinov3-small_fpn_1x_coco']


@pytest.fixture(scope='module')
def written_configs(tmp_path_factory):
    spec = importlib.util.spec_from_file_location('make_config',
                                                  REPO / 'tools' / 'misc' / 'make_config.py')
    make_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_config)
    folder = tmp_path_factory.mktemp('written_configs')
    for name in WRITTEN:
        path, text = make_config.render(name, folder)
        path.write_text(text)
    return folder


@pytest.mark.parametrize('name', WRITTEN)
def test_config_written_by_make_config_builds_and_runs(name, written_configs,
                                                       softmax_checkpoint,
                                                       classification_checkpoints):
    cfg = Config.fromfile(str(written_configs / f'{name}.py'))
    model = build_and_run(cfg, softmax_checkpoint, classification_checkpoints)
    if '-hybrid-' in name:  # Softmax in the first and last of the blocks the test builds
        op = name.split('-adapter-')[1].split('-')[0]
        assert model.backbone.vit.attn_types == ['softmax', op, op, 'softmax']
