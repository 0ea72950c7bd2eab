"""FSDP through mmengine's FlexibleRunner: tools/dist_train.sh starts 2 CPU processes (gloo)
that train a tiny DINOv2-shaped relu student, distilled from a Softmax teacher that the hook
holds (never wrapped or sharded), with the FSDP settings of configs/classification/fsdp/;
rank 0 writes one full checkpoint that a LinearViT and the ViT-Adapter load strictly."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.models import LinearViT, LinearViTAdapter

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FSDP_BASE = REPO / 'configs/classification/fsdp/_base_/fsdp_32xb128_in1k.py'
FSDP_LEAF = (REPO / 'configs/classification/fsdp/'
             'linvit-relu-dinov2-large_fullcopy-distill_fsdp-32xb128_in1k.py')
DEMO = REPO / 'configs/demo/linvit-relu-mini_fullcopy-distill_1xb24_mini-groups.py'
SIZES = dict(embed_dims=48, num_layers=4, num_heads=3, feedforward_channels=96)
ARCH = dict(LinearViT.arch_zoo['dinov2-small'], **SIZES)


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def test_the_fsdp_configs_use_the_flexible_runner():
    leaf = Config.fromfile(str(FSDP_LEAF))
    assert leaf.runner_type == 'FlexibleRunner' and leaf.strategy.type == 'ParamGroupFSDPStrategy'
    assert leaf.optim_wrapper.type == 'ShardedOptimWrapper'
    assert leaf.optim_wrapper.clip_grad == dict(max_norm=3.0)  # the recipe's, kept
    assert leaf.model.backbone.arch == 'dinov2-large'
    assert leaf.custom_hooks[0].teacher.arch == 'dinov2-large'


@pytest.fixture(scope='module')
def source_checkpoint(tmp_path_factory):
    import timm
    torch.manual_seed(0)
    model = timm.create_model('vit_small_patch14_dinov2', pretrained=False, img_size=64,
                              num_classes=0, embed_dim=SIZES['embed_dims'],
                              depth=SIZES['num_layers'], num_heads=SIZES['num_heads'],
                              mlp_ratio=SIZES['feedforward_channels'] / SIZES['embed_dims'])
    path = tmp_path_factory.mktemp('source') / 'dinov2_tiny.pth'
    torch.save(model.state_dict(), path)
    return path


def test_two_cpu_processes_train_with_fsdp(mini_data_root, source_checkpoint, tmp_path):
    fsdp = Config.fromfile(str(FSDP_BASE))
    config = tmp_path / 'fsdp_mini.py'
    config.write_text(f"""_base_ = {str(DEMO)!r}
arch = {ARCH!r}
checkpoint = {str(source_checkpoint)!r}
runner_type = {fsdp.runner_type!r}
strategy = {fsdp.strategy.to_dict()!r}
optim_wrapper = dict(type={fsdp.optim_wrapper.type!r}, clip_grad=dict(max_norm=0.01))
model = dict(backbone=dict(arch=dict(_delete_=True, **arch), patch_size=None,
                           init_cfg=dict(checkpoint=checkpoint)),
             head=dict(in_channels=arch['embed_dims']))
custom_hooks = [dict(
    type='AttentionDistillHook', loss_weight=50.0, target='output',
    teacher=dict(type='LinearViT', arch=arch, attn_type='softmax', img_size=64,
                 init_cfg=dict(type='SoftmaxTransfer', checkpoint=checkpoint,
                               setting='fullcopy')))]
""")
    root = mini_data_root / 'imagenet_groups'
    options = [f'{loader}.dataset.data_root={root}'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += ['train_cfg.max_iters=2', 'train_cfg.val_interval=2',
                'default_hooks.checkpoint.interval=2', 'train_dataloader.batch_size=4',
                'default_hooks.logger.interval=1', 'train_dataloader.num_workers=0',
                'val_dataloader.num_workers=0']
    env = dict(os.environ, PORT=str(free_port()), OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')
    result = subprocess.run(
        ['bash', str(REPO / 'tools/dist_train.sh'), str(config), '2', '--work-dir',
         str(tmp_path / 'work'), '--cfg-options', *options],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert 'no CUDA: ParamGroupFSDPStrategy on CPU processes' in log
    assert 'no CUDA: gloo process group, rank 0 of 2' in log
    # the teacher the hook holds is the plain model, not an FSDP unit
    assert 'from a frozen LinearViT teacher' in log
    assert 'loss_distill' in log and 'grad_norm' in log and 'Iter(train) [2/' in log
    # the recipe's parameter groups, as on the unwrapped model: no decay on norms and
    # LayerScale, decay on the weight matrices (FSDP's flat shards would all look 1-D)
    assert 'backbone.layers.0.ln1.weight:weight_decay=0.0' in log
    assert 'backbone.layers.0.attn.gamma1.weight:weight_decay=0.0' in log
    assert 'attn.qkv.weight:weight_decay' not in log and '_fsdp_wrapped_module' not in log

    # one full checkpoint, in the names of the unwrapped model
    state = torch.load(tmp_path / 'work' / 'iter_2.pth', map_location='cpu',
                       weights_only=False)['state_dict']
    assert not [key for key in state if '_fsdp' in key or 'flat_param' in key]
    source = torch.load(source_checkpoint, weights_only=True)
    # copied (FullCopy), then moved by the optimizer on the shards
    assert state['backbone.layers.0.attn.qkv.weight'].shape == \
        source['blocks.0.attn.qkv.weight'].shape
    assert not torch.equal(state['backbone.layers.0.attn.qkv.weight'],
                           source['blocks.0.attn.qkv.weight'])
    vit = LinearViT(arch=ARCH, attn_type='relu', img_size=64)
    vit.load_state_dict({k[len('backbone.'):]: v for k, v in state.items()
                         if k.startswith('backbone.')})
    adapter = LinearViTAdapter(vit=dict(arch=ARCH, attn_type='relu', img_size=64),
                               conv_inplane=8, deform_num_heads=3, deform_ratio=1.0,
                               pretrained=str(tmp_path / 'work' / 'iter_2.pth'))
    adapter.init_weights()
    assert torch.equal(adapter.vit.layers[3].attn.qkv.weight,
                       state['backbone.layers.3.attn.qkv.weight'])
