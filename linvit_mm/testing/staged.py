"""Tiny set-ups of the staged recipe for the tests and the demo-sized checks.

A Softmax teacher checkpoint whose attention is far from uniform (a freshly initialised ViT
attends almost uniformly, which any linear operator matches at once, so alignment would have
nothing to learn), the configs of tiny student and teacher LinearViTs, and checkpoints that
carry the record of :mod:`linvit_mm.staged.record`.
"""
import copy

import torch

__all__ = ['TINY_ARCH', 'teacher_cfg', 'tiny_vit_cfg', 'write_recorded_checkpoint',
           'write_softmax_teacher']

TINY_ARCH = dict(embed_dims=32, num_layers=3, num_heads=2, feedforward_channels=64)
IMG_SIZE = 32
PATCH_SIZE = 8


def tiny_vit_cfg(attn_type, arch=TINY_ARCH, **overrides):
    """Config of a tiny LinearViT (32 px, 8-pixel patches: a 4 x 4 grid)."""
    cfg = dict(type='LinearViT', arch=copy.deepcopy(arch), attn_type=attn_type,
               img_size=IMG_SIZE, patch_size=PATCH_SIZE)
    cfg.update(overrides)
    return cfg


def write_softmax_teacher(path, arch=TINY_ARCH, seed=0, qk_std=0.35, **overrides):
    """A tiny Softmax LinearViT in an mmpretrain-style checkpoint (``backbone.*`` keys).

    Its query and key rows are redrawn with a large ``qk_std`` so that every head's map is
    peaked rather than nearly uniform. Returns the path.
    """
    from linvit_mm.models import LinearViT
    torch.manual_seed(seed)
    cfg = tiny_vit_cfg('softmax', arch, **overrides)
    cfg.pop('type')
    vit = LinearViT(**cfg)
    width = vit.embed_dims
    with torch.no_grad():
        for layer in vit.layers:
            layer.attn.qkv.weight[:2 * width].normal_(0, qk_std)
    state = {f'backbone.{key}': value for key, value in vit.state_dict().items()}
    torch.save(dict(state_dict=state, meta={}), str(path))
    return path


def teacher_cfg(checkpoint, arch=TINY_ARCH, **overrides):
    """The tiny Softmax teacher's config, loading ``checkpoint`` (see
    :func:`write_softmax_teacher`)."""
    return tiny_vit_cfg('softmax', arch, **overrides, init_cfg=dict(
        type='Pretrained', checkpoint=str(checkpoint), prefix='backbone.'))


def write_recorded_checkpoint(path, vit, prefix='backbone.', **stage):
    """Save ``vit`` under ``prefix`` with its record (and ``stage`` entries) in the meta."""
    from linvit_mm.staged import RECORD_KEY, describe_linear_vit
    state = {prefix + key: value for key, value in vit.state_dict().items()}
    record = dict(backbones={prefix: describe_linear_vit(vit)}, **stage)
    torch.save(dict(state_dict=state, meta={RECORD_KEY: record}), str(path))
    return path
