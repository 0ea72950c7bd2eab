"""The staged recipe end to end through tools/train.py and the demo configs: attention
alignment, feature alignment, fine-tuning (dense and LoRA), each stage loading the last
one's checkpoint; the merged LoRA checkpoint loads into a dense-prediction backbone."""
import importlib.util
from pathlib import Path

import pytest
import torch

from linvit_mm.testing.staged import write_softmax_teacher

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / 'configs' / 'demo'
ALIGN_ATTN = DEMO / 'linvit-relu-mini_align-attn_1xb24_mini-groups.py'
ALIGN_FEAT = DEMO / 'linvit-relu-mini_align-feat_1xb24_mini-groups.py'
STAGED_FT = DEMO / 'linvit-relu-mini_staged-ft_1xb24_mini-groups.py'
STAGED_LORA = DEMO / 'linvit-relu-mini_staged-lora_1xb24_mini-groups.py'
# The demo's mini ViT, made smaller still so that each stage takes seconds.
ARCH = dict(embed_dims=48, num_layers=2, num_heads=3, feedforward_channels=96)
ITERS = 2


def load_merge_lora():
    path = REPO / 'tools' / 'model_converters' / 'merge_lora.py'
    spec = importlib.util.spec_from_file_location('merge_lora_tool', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arch_options(*vits):
    return [f'{vit}.arch.{key}={value}' for vit in vits for key, value in ARCH.items()]


@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('staged_e2e') / 'softmax.pth',
                                 arch=ARCH, img_size=64)


def common_options(mini_data_root, labelled=False):
    root = mini_data_root / 'imagenet_groups'
    loaders = ['train_dataloader'] + (['val_dataloader', 'test_dataloader'] if labelled else [])
    return [f'{loader}.dataset.data_root={root}' for loader in loaders] + [
        f'train_cfg.max_iters={ITERS}', f'train_cfg.val_interval={ITERS}',
        f'default_hooks.checkpoint.interval={ITERS}', 'default_hooks.logger.interval=1',
        'train_dataloader.batch_size=4']


@pytest.fixture(scope='module')
def work(tmp_path_factory):
    return tmp_path_factory.mktemp('staged_runs')


@pytest.fixture(scope='module')
def stage1(tools, mini_data_root, teacher, work):
    """Stage 1, attention alignment: the checkpoint and the run's log."""
    _, log = tools.train([ALIGN_ATTN, '--work-dir', work / 'attn', '--cfg-options',
                          *common_options(mini_data_root),
                          *arch_options('model.backbone', 'model.teacher'),
                          f'model.teacher.init_cfg.checkpoint={teacher}'])
    return work / 'attn' / f'iter_{ITERS}.pth', log


@pytest.fixture(scope='module')
def stage2(tools, mini_data_root, teacher, work, stage1):
    """Stage 2, feature alignment from stage 1: the checkpoint and the run's log."""
    _, log = tools.train([ALIGN_FEAT, '--work-dir', work / 'feat', '--cfg-options',
                          *common_options(mini_data_root),
                          *arch_options('model.backbone', 'model.teacher'),
                          f'model.teacher.init_cfg.checkpoint={teacher}',
                          f'model.backbone.init_cfg.checkpoint={stage1[0]}'])
    return work / 'feat' / f'iter_{ITERS}.pth', log


def staged_ft_options(mini_data_root, stage2_checkpoint):
    return [*common_options(mini_data_root, labelled=True), *arch_options('model.backbone'),
            'model.head.in_channels=48', f'model.backbone.init_cfg.checkpoint={stage2_checkpoint}']


def lora_options(mini_data_root, stage2_checkpoint):
    return [*common_options(mini_data_root, labelled=True),
            *arch_options('model.backbone.module'), 'model.head.in_channels=48',
            f'model.backbone.module.init_cfg.checkpoint={stage2_checkpoint}']


def test_staged_stage1_align_attn_run(stage1):
    from linvit_mm.staged import RECORD_KEY
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    checkpoint, log = stage1
    assert 'loss_align' in log
    record = load_checkpoint_file(checkpoint)['meta'][RECORD_KEY]
    assert record['stage'] == 'align-attn' and record['trained_layers'] == [0, 1]


def test_staged_stage2_align_feat_loads_stage1(stage2):
    _, log = stage2
    assert "LinearViTCheckpoint: loaded" in log and "(stage 'align-attn')" in log
    assert 'loss_feat_mse' in log


def test_staged_stage3_fine_tuning_loads_stage2(tools, mini_data_root, stage2, work):
    _, log = tools.train([STAGED_FT, '--work-dir', work / 'ft', '--cfg-options',
                          *staged_ft_options(mini_data_root, stage2[0])])
    assert "(stage 'align-feat')" in log and 'accuracy/top1' in log


def test_staged_stage3_lora_merged_is_the_plain_model(tools, mini_data_root, stage2, work):
    from mmpretrain.registry import MODELS

    from linvit_mm.utils.checkpoint import load_checkpoint_file
    options = lora_options(mini_data_root, stage2[0])
    _, log = tools.train([STAGED_LORA, '--work-dir', work / 'lora', '--cfg-options', *options])
    assert "(stage 'align-feat')" in log and 'accuracy/top1' in log
    lora_ckpt = work / 'lora' / f'iter_{ITERS}.pth'
    assert all('lora_' in k or k.startswith('head.')
               for k in load_checkpoint_file(lora_ckpt)['state_dict'])
    merged = work / 'merged.pth'
    assert load_merge_lora().main([str(STAGED_LORA), str(lora_ckpt), str(merged),
                                   '--cfg-options', *options]) == 0

    # a plain classifier of the same model gives the LoRA run's accuracy with it
    metrics, _ = tools.test([STAGED_FT, merged, '--work-dir', work / 'test', '--cfg-options',
                             *staged_ft_options(mini_data_root, stage2[0])])
    lora_metrics, _ = tools.test([STAGED_LORA, lora_ckpt, '--work-dir', work / 'test_lora',
                                  '--cfg-options', *options])
    assert metrics['accuracy/top1'] == pytest.approx(lora_metrics['accuracy/top1'], abs=1e-6)
    # ... and a dense-prediction backbone takes it as any classification checkpoint
    adapter = MODELS.build(dict(
        type='LinearViTAdapter', vit=dict(arch=ARCH, attn_type='relu', img_size=64,
                                          patch_size=8),
        interaction_indexes=[[0, 0], [1, 1]], deform_num_heads=3, deform_ratio=1.0,
        conv_inplane=8, vit_feature_mode='last', pretrained=str(merged)))
    adapter.init_weights()
    state = load_checkpoint_file(merged)['state_dict']
    for key, value in adapter.vit.state_dict().items():
        assert torch.equal(value, state[f'backbone.{key}']), key


def test_staged_feature_alignment_refuses_stage1_of_another_operator(tools, mini_data_root,
                                                                      teacher, tmp_path):
    from linvit_mm.testing.staged import write_recorded_checkpoint
    from mmpretrain.registry import MODELS
    relu = MODELS.build(dict(type='LinearViT', arch=ARCH, attn_type='relu', img_size=64,
                             patch_size=8))
    stage1 = write_recorded_checkpoint(tmp_path / 'relu_stage1.pth', relu, stage='align-attn',
                                       trained_layers=[0, 1])
    with pytest.raises(ValueError) as info:
        tools.train([ALIGN_FEAT, '--work-dir', tmp_path / 'feat', '--cfg-options',
                     *common_options(mini_data_root),
                     *arch_options('model.backbone', 'model.teacher'),
                     'model.backbone.attn_type=elu',
                     f'model.teacher.init_cfg.checkpoint={teacher}',
                     f'model.backbone.init_cfg.checkpoint={stage1}'])
    assert "operator of blocks 0-1: checkpoint 'relu', model 'elu'" in str(info.value)
    assert not (tmp_path / 'feat' / f'iter_{ITERS}.pth').exists()
