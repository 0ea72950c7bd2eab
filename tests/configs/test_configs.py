"""Every config under configs/ loads, builds with a tiny backbone, initialises and runs.

The real recipes are kept (heads, necks, data preprocessors, optimizer wrappers, hooks,
dataset/transform/metric types); only the backbone is shrunk and the checkpoints are
replaced by tiny ones written here, so no config can rot unnoticed.
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import DefaultScope, init_default_scope

REPO = Path(__file__).resolve().parents[2]
CONFIG_ROOT = REPO / 'configs'
CONFIGS = sorted(p for p in CONFIG_ROOT.rglob('*.py') if '_base_' not in p.parts)
TINY_ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
# Four blocks: the segmentation adapter adds interaction i's output to level i.
DENSE_ARCH = dict(TINY_ARCH, num_layers=4)
IMG = 32  # classification input side; two 16-pixel patches a side


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
    """Per operator, a tiny classification-stage checkpoint (``backbone.`` prefix)."""
    from linvit_mm.models import LinearViT
    root = tmp_path_factory.mktemp('cls_stage')
    paths = {}

    def get(attn_type, patch_size):
        key = attn_type, patch_size
        if key not in paths:
            vit = LinearViT(arch=DENSE_ARCH, attn_type=attn_type, img_size=224,
                            patch_size=patch_size)
            vit.init_weights()
            state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
            state['head.layers.head.weight'] = torch.zeros(1000, 32)
            paths[key] = str(root / f'{attn_type}_patch{patch_size}.pth')
            torch.save({'state_dict': state, 'meta': {}}, paths[key])
        return paths[key]

    return get


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
        dataset = cfg[loader]['dataset']
        assert resolves(DATASETS, scope, dataset['type']), dataset['type']
        for transform in dataset.get('pipeline', []):
            assert resolves(TRANSFORMS, scope, transform['type']), transform['type']
    for key in ('val_evaluator', 'test_evaluator'):
        evaluators = cfg[key] if isinstance(cfg[key], list) else [cfg[key]]
        for evaluator in evaluators:
            assert resolves(METRICS, scope, evaluator['type']), evaluator['type']
    for hook in cfg.get('custom_hooks', []):
        HOOKS.build(hook)


def run_classification(cfg, softmax_checkpoint):
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    backbone = cfg.model.backbone
    backbone.update(arch=TINY_ARCH, img_size=IMG, patch_size=16)
    retarget_transfer(backbone.init_cfg, softmax_checkpoint)
    cfg.model.head.in_channels = TINY_ARCH['embed_dims']
    if cfg.model.head.get('init_cfg'):
        retarget_transfer(cfg.model.head.init_cfg, softmax_checkpoint)
    model = MODELS.build(cfg.model)
    model.init_weights()
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
            teacher_cfg = hook['teacher']
            teacher_cfg.update(arch=TINY_ARCH, img_size=IMG, patch_size=16)
            retarget_transfer(teacher_cfg.init_cfg, softmax_checkpoint)
            teacher = MODELS.build(teacher_cfg)
            teacher.init_weights()
    return model


def shrink_adapter(cfg, checkpoint):
    backbone = cfg.model.backbone
    backbone.vit.update(arch=DENSE_ARCH)
    backbone.update(interaction_indexes=[[0, 0], [1, 1], [2, 2], [3, 3]], deform_num_heads=2,
                    deform_ratio=1.0, conv_inplane=8, pretrained=checkpoint)


def run_detection(cfg, checkpoint):
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData
    shrink_adapter(cfg, checkpoint)
    cfg.model.neck.in_channels = [TINY_ARCH['embed_dims']] * 4
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


def run_segmentation(cfg, checkpoint):
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    shrink_adapter(cfg, checkpoint)
    width = TINY_ARCH['embed_dims']
    cfg.model.decode_head.in_channels = [width] * 4
    cfg.model.auxiliary_head.in_channels = width
    cfg.model.data_preprocessor.size = (96, 128)
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


def test_configs_exist_for_every_operator_size_and_task():
    names = {config_id(p) for p in CONFIGS}
    for op in ('softmax', 'elu', 'relu', 'inline', 'mhla', 'ttt'):
        for size in ('tiny', 'small', 'base'):
            assert f'detection/mask-rcnn_linvit-adapter-{op}-{size}_fpn_1x_coco.py' in names
            assert (f'segmentation/upernet_linvit-adapter-{op}-{size}_8xb2-160k_'
                    'ade20k-512x512.py') in names
            settings = ['random', 'copy', 'mlpcopy', 'fullcopy']
            if op != 'ttt':
                settings += ['mimetic', 'impulse']
            for setting in settings:
                for distill in ('', '-distill'):
                    assert (f'classification/imagenet/linvit-{op}-{size}_{setting}{distill}_'
                            '32xb128_in1k.py') in names


@pytest.mark.parametrize('config', CONFIGS, ids=config_id)
def test_config_builds_and_runs(config, softmax_checkpoint, classification_checkpoints):
    cfg = Config.fromfile(str(config))
    scope = cfg.get('default_scope', 'mmpretrain')
    init_default_scope(scope)
    with DefaultScope.overwrite_default_scope(scope):
        check_registered(cfg, scope)
        if scope == 'mmpretrain':
            model = run_classification(cfg, softmax_checkpoint)
        else:
            vit = cfg.model.backbone.vit
            # the demo's mini ViT uses 8-pixel patches; the checkpoint must match the model
            checkpoint = classification_checkpoints(vit.attn_type, vit.get('patch_size', 16))
            model = (run_detection if scope == 'mmdet' else run_segmentation)(cfg, checkpoint)
        build_optim_wrapper(model, cfg.optim_wrapper)
