"""Released linear-attention ViTs as LinearViT checkpoints: conversion and a strict loader.

A Softmax transfer reads a Softmax ViT and leaves every operator-specific tensor at its
init; a released *linear* ViT already holds trained ones, so it is converted instead, tensor
for tensor, into the LinearViT that computes the official forward:

==============  ======================  =========  ==========================================
release         repository              operator   arch words (sizes)
==============  ======================  =========  ==========================================
ViT³-T/S/B      LeapLabTHU/ViTTT        ``ttt``    ``vit3-tiny`` (192, 6 heads),
                                                   ``vit3-small`` (384, 6), ``vit3-base``
                                                   (768, 12); no class token, no position
                                                   embedding, mean of the final-normed tokens
InLine-DeiT-T   LeapLabTHU/InLine       ``inline`` ``inline-deit-tiny`` (192, 6 heads),
/S/B                                    residual   ``inline-deit-small`` (320, 10),
                                        on         ``inline-deit-base`` (384, 12); class
                                                   token and learned position embedding
MHLA ViT-T/S/B  DAGroup-PKU/MHLA        ``mhla``,  ``mhla-tiny`` (192, 3), ``mhla-small``
                                        official   (384, 6), ``mhla-base`` (768, 12); no
                                        switches   class token, learned embedding, pooled
                                                   norm; 256 px (16 x 16 patches), blocks
                                                   from the mixing conv (4 x 4 of 4 x 4)
==============  ======================  =========  ==========================================

The MHLA ViT zero-pads its (normalised) 224 px input to 256 px before the patch embedding;
LinearViT does not: give the converted model the padded 256 px image to compute theirs.

Every tensor of the release must have a place (an unknown one is refused by name, nothing
is dropped), and the model it is loaded into must have a tensor of the same shape for each
and no other (:func:`load_linear_release` refuses missing, unexpected and reshaped tensors
by name before anything is copied). The sizes come from the tensors (width and patch size
from the patch embedding, depth from the blocks, heads from ``attn.w1`` (ViT³) or the
grouped ``attn.residual.0`` conv (InLine) or, for MHLA, whose tensors do not hold them, the
released width or ``num_heads``; MLP width from ``fc1``; MHLA's block layout from its mixing
conv and its grid from ``pos_embed``), the arch word from the sizes where one fits. The
family is told by :func:`linvit_mm.transfer.linear_sources.detect_linear_source`; the layouts
are in :mod:`linvit_mm.transfer.linear_release_layouts`.
"""
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Mapping

import torch

from .linear_release_layouts import HEAD_KEYS, LINEAR_RELEASES, LinearRelease
from .linear_sources import detect_linear_source

__all__ = ['LinearRelease', 'LINEAR_RELEASES', 'ConvertedRelease', 'release_state_dict',
           'convert_linear_release', 'build_release_vit', 'load_linear_release',
           'converted_checkpoint']


@dataclass
class ConvertedRelease:
    """A release in LinearViT's names.

    Attributes:
        release: its layout.
        backbone: the LinearViT state dict (no prefix).
        head: the classifier under ``head.layers.head.*`` (empty if the release has none).
        model_cfg: the LinearViT that computes the official forward (a config dict).
        notes: what the conversion did that a user should hear about.
    """
    release: LinearRelease
    backbone: Dict[str, torch.Tensor]
    head: Dict[str, torch.Tensor]
    model_cfg: dict
    notes: List[str]


def release_state_dict(checkpoint):
    """The model tensors of a loaded release file: the official trainers save
    ``{'model': state_dict, 'optimizer': ..., ...}``; a bare state dict and one under
    ``state_dict`` are taken too, and a ``module.`` prefix (DistributedDataParallel) is
    dropped."""
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f'a release checkpoint is a mapping, got {type(checkpoint).__name__}')
    for container in ('model', 'state_dict'):
        if isinstance(checkpoint.get(container), Mapping):
            checkpoint = checkpoint[container]
            break
    state = OrderedDict((key, value) for key, value in checkpoint.items()
                        if torch.is_tensor(value))
    if not state:
        raise ValueError('the checkpoint holds no tensors (looked at the top level, under '
                         "'model' and under 'state_dict')")
    if all(key.startswith('module.') for key in state):
        state = OrderedDict((key[len('module.'):], value) for key, value in state.items())
    return state


def _find_release(state, family):
    if family is not None:
        if family not in LINEAR_RELEASES:
            raise ValueError(f'unknown release family {family!r}; the converter reads '
                             f'{", ".join(LINEAR_RELEASES)}')
        return LINEAR_RELEASES[family]
    match = detect_linear_source(state)
    if match is None:
        raise ValueError('the checkpoint is not one of a released linear ViT (no tensor of '
                         f'{", ".join(r.description for r in LINEAR_RELEASES.values())}); '
                         'a Softmax ViT is transferred with SoftmaxTransfer instead')
    if match.source.name not in LINEAR_RELEASES:
        raise ValueError(f'the checkpoint is a {match.source.description} checkpoint '
                         f'({match.describe()}), which this converter does not read (it '
                         f'reads {", ".join(LINEAR_RELEASES)}); {match.source.instead}')
    return LINEAR_RELEASES[match.source.name]


def _sizes(state, release, num_heads=None, force_num_heads=False):
    """``(arch, img_size, qkv_bias)`` from the tensors; the arch is a word where the sizes
    are one's."""
    for key in ('patch_embed.proj.weight', 'blocks.0.mlp.fc1.weight', release.heads_from,
                'blocks.0.attn.qkv.weight' if release.name != 'mhla' else
                'blocks.0.attn.to_qkv.weight'):
        if key not in state:
            raise ValueError(f'the {release.description} checkpoint has no {key}, which its '
                             f'layout always has; is it cut short?')
    patch = state['patch_embed.proj.weight']
    if patch.dim() != 4 or patch.shape[2] != patch.shape[3]:
        raise ValueError(f'patch_embed.proj.weight has shape {tuple(patch.shape)}; a square '
                         f'patch conv (C, in, p, p) was expected')
    embed_dims, patch_size = patch.shape[0], patch.shape[2]
    blocks = sorted({int(m.group(1)) for key in state
                     for m in [re.match(r'blocks\.(\d+)\.', key)] if m})
    if blocks != list(range(len(blocks))):
        raise ValueError(f'the blocks of the checkpoint are numbered {blocks}, not 0..N-1')
    found = None if release.name == 'mhla' and num_heads else int(
        release.num_heads(state, embed_dims))
    if found is not None and num_heads and found != num_heads:
        raise ValueError(f'num_heads={num_heads} was given, but {release.heads_from} of shape '
                         f'{tuple(state[release.heads_from].shape)} holds {found} heads')
    released = {width: heads for width, heads in release.arch_words.values()}
    if (found is None and embed_dims in released and num_heads != released[embed_dims]
            and not force_num_heads):
        raise ValueError(f'num_heads={num_heads} was given for a {release.description} of '
                         f'width {embed_dims}, which is released with {released[embed_dims]} '
                         f'heads; its tensors would load into {num_heads} heads and compute '
                         f'another function. Leave the count out, or force it '
                         f'(--force-num-heads) for a model of your own trained with '
                         f'{num_heads} heads')
    num_heads = int(num_heads or found)
    if num_heads <= 0 or embed_dims % num_heads:
        raise ValueError(f'{num_heads} heads do not divide the width {embed_dims} '
                         f'({release.heads_from}: {tuple(state[release.heads_from].shape)})')
    ffn = state['blocks.0.mlp.fc1.weight'].shape[0]
    arch = dict(embed_dims=int(embed_dims), num_layers=len(blocks), num_heads=num_heads,
                feedforward_channels=int(ffn))
    word = next((word for word, (width, heads) in release.arch_words.items()
                 if arch == dict(embed_dims=width, num_layers=12, num_heads=heads,
                                 feedforward_channels=4 * width)), None)
    qkv_bias = any(key in state for key in ('blocks.0.attn.qkv.bias',
                                            'blocks.0.attn.to_qkv.bias'))
    # the words set the released qkv bias: with bias for ViT^3 and InLine, without for MHLA
    if word is not None and patch_size == 16 and qkv_bias == (release.name != 'mhla'):
        arch = word
    else:
        arch['patch_size'] = int(patch_size)
        arch.update(release.arch_switches)
    img_size = 224
    if 'pos_embed' in state:
        patches = state['pos_embed'].shape[1] - release.extra_slots
        side = math.isqrt(max(patches, 0))
        if patches <= 0 or side * side != patches:
            raise ValueError(f'pos_embed has shape {tuple(state["pos_embed"].shape)}: not '
                             f'{release.extra_slots} class token slot(s) and a square grid')
        img_size = side * int(patch_size)
    return arch, img_size, qkv_bias


def convert_linear_release(checkpoint, family=None, num_heads=None, force_num_heads=False):
    """A release's tensors in LinearViT's names, and the LinearViT config that computes its
    forward.

    Args:
        checkpoint (Mapping): the loaded release file (see :func:`release_state_dict`).
        family (str, optional): ``'vit3'``, ``'inline'`` or ``'mhla'``; None: told from the
            keys.
        num_heads (int, optional): the head count, checked against the tensors where they
            hold it (ViT³, InLine); needed for an MHLA ViT of a width other than the
            released 192 / 384 / 768, whose tensors do not hold it. At a released MHLA
            width another count than the release's is refused unless ``force_num_heads``:
            the tensors would load, and compute another function.

    Returns:
        ConvertedRelease

    Raises:
        ValueError: not a release this converter reads, or a tensor without a place (all
            such named), or sizes that do not fit together.
    """
    state = release_state_dict(checkpoint)
    release = _find_release(state, family)
    from .formats import refuse_non_float
    refuse_non_float(state, {}, f'the {release.description} checkpoint')
    arch, img_size, qkv_bias = _sizes(state, release, num_heads, force_num_heads)
    # read before the tensors are reshaped: it checks the shapes it reads
    attn_cfg = dict(release.attn_cfg)
    if release.attn_cfg_from is not None:
        attn_cfg.update(release.attn_cfg_from(state))
    backbone, head, unplaced = OrderedDict(), OrderedDict(), []
    for key, value in state.items():
        block = re.match(r'^blocks\.(\d+)\.(.+)$', key)
        if block and block.group(2) in release.block:
            ours = release.block[block.group(2)]
            reshape = release.reshape.get(ours)
            backbone[f'layers.{block.group(1)}.{ours}'] = (value if reshape is None
                                                           else reshape(value))
        elif key in release.top:
            backbone[release.top[key]] = value
        elif key in HEAD_KEYS:
            head[HEAD_KEYS[key]] = value
        else:
            unplaced.append(key)
    if unplaced:
        raise ValueError(f'the {release.description} checkpoint holds tensors that have no '
                         f'place in its layout ({release.repository}): {", ".join(unplaced)}; '
                         f'nothing was converted')
    model_cfg = dict(type='LinearViT', arch=arch, attn_type=release.attn_type,
                     img_size=img_size)
    if attn_cfg:
        model_cfg['attn_cfg'] = attn_cfg
    if isinstance(arch, dict):
        arch['qkv_bias'] = qkv_bias
    notes = []
    if release.name == 'mhla':
        notes.append('the official model zero-pads its normalised input to 256 px (16 x 16 '
                     'patches) before the patch embedding; give the LinearViT the padded image')
    if not head:
        notes.append('no classifier (head.weight / head.bias) in the checkpoint')
    return ConvertedRelease(release, backbone, head, model_cfg, notes)


def build_release_vit(converted):
    """The LinearViT of ``converted.model_cfg`` (its init; load with
    :func:`load_linear_release`)."""
    from linvit_mm.models.backbones import LinearViT
    kwargs = {k: v for k, v in converted.model_cfg.items() if k != 'type'}
    return LinearViT(**kwargs)


# What the model computes beyond its tensors: a model that differs from the release's in one
# of these loads every tensor and computes another network (a sin-cos position embedding the
# release does not add, say).
_FUNCTION_SWITCHES = ('with_cls_token', 'num_register_tokens', 'pos_embed_type',
                      'no_embed_class', 'ffn_type', 'final_norm', 'pooled_norm')


def _function_problems(vit, converted, reported_options):
    """How ``vit`` computes another function than the release's model on the same tensors:
    its switches and its blocks' operator options and windows; ``reported_options`` are
    options already named."""
    import torch

    from linvit_mm.staged.record import describe_linear_vit, option_differences
    with torch.device('meta'):  # the switches only: no memory, no init
        reference = build_release_vit(converted)
    switches = {name: (getattr(reference, name), getattr(vit, name))
                for name in _FUNCTION_SWITCHES}
    switches['pre_norm'] = tuple(type(m.pre_norm).__name__ != 'Identity'
                                 for m in (reference, vit))
    switches['norm eps'] = tuple(m.layers[0].ln1.eps for m in (reference, vit))
    problems = [f'{name}: the release {have!r}, the model {want!r}'
                for name, (have, want) in switches.items() if have != want]
    if reference.attn_types == vit.attn_types:
        problems += [
            f'{what} of blocks {blocks}: the release {have!r}, the model {want!r}'
            for what, blocks, have, want in option_differences(describe_linear_vit(reference),
                                                               describe_linear_vit(vit))
            if what.split('.')[-1] not in reported_options]
    return problems


def _operator_problems(vit, release):
    """``(problems, options they name)``."""
    problems, named = [], set()
    wrong = [i for i, name in enumerate(vit.attn_types) if name != release.attn_type]
    if wrong:
        problems.append(f'blocks {wrong} run {sorted({vit.attn_types[i] for i in wrong})}, '
                        f'the release runs {release.attn_type!r} in every block')
    if release.name == 'mhla' and not wrong:
        other = [i for i, layer in enumerate(vit.layers)
                 if getattr(layer.attn, 'normaliser', None) != 'official']
        if other:
            named.add('normaliser')
            problems.append(f"blocks {other} do not use the official normaliser (attn_cfg="
                            f"dict(normaliser='official')), which the release's blocks use")
    if release.name == 'inline':
        off = [i for i, layer in enumerate(vit.layers)
               if getattr(layer.attn, 'residual', None) is None]
        if off and not wrong:
            named.add('residual')
            problems.append(f"blocks {off} have no local residual branch (attn_cfg=dict("
                            f"residual=True)), which the release's blocks use")
    return problems, named


def load_linear_release(vit, checkpoint, family=None, logger='current'):
    """Load a release into the LinearViT ``vit`` strictly: every tensor of ``vit`` from
    the release, every tensor of the release into ``vit``, shapes equal, the release's
    operator in every block; all problems named before anything is copied.

    Args:
        vit (LinearViT): the model (e.g. from :func:`build_release_vit`).
        checkpoint (Mapping | ConvertedRelease): a loaded release file, or its conversion.
        family (str, optional): see :func:`convert_linear_release`.

    Returns:
        ConvertedRelease: the conversion that was loaded.
    """
    from mmengine.logging import print_log

    from linvit_mm.models.backbones import LinearViT
    if not isinstance(vit, LinearViT):
        raise TypeError(f'a release loads into a LinearViT, got {type(vit).__name__}')
    converted = (checkpoint if isinstance(checkpoint, ConvertedRelease)
                 else convert_linear_release(checkpoint, family))
    release, state = converted.release, converted.backbone
    problems, named = _operator_problems(vit, release)
    problems += _function_problems(vit, converted, named)
    expected = vit.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    reshaped = [f'{key}: release {tuple(state[key].shape)}, model {tuple(expected[key].shape)}'
                for key in state if key in expected and state[key].shape != expected[key].shape]
    if missing:
        problems.append('tensors of the model the release does not have: ' + ', '.join(missing))
    if unexpected:
        problems.append('tensors of the release the model does not have: '
                        + ', '.join(unexpected))
    if reshaped:
        problems.append('shapes that differ: ' + '; '.join(reshaped))
    if problems:
        raise ValueError(f'the {release.description} release does not fit the model, nothing '
                         f'was loaded (the model that fits: {converted.model_cfg}):\n  - '
                         + '\n  - '.join(problems))
    from .formats import refuse_non_finite
    refuse_non_finite(state, {}, f'the {release.description} release')
    vit.load_state_dict(state, strict=True)
    print_log(f'loaded the {release.description} release ({release.repository}): '
              f'{len(state)} tensors into a {release.attn_type} LinearViT'
              + ''.join(f'; {note}' for note in converted.notes), logger=logger)
    return converted


def converted_checkpoint(converted, vit=None):
    """The converted release as a linvit_mm checkpoint: ``backbone.*`` and the classifier
    ``head.layers.head.*`` under ``state_dict``, and the record of the ViT (its operator per
    block, heads, sizes) under ``meta['linvit_mm']``, so ``LinearViTCheckpoint`` loads it
    strictly. ``vit`` (built and loaded here when None) is the model the record describes."""
    from linvit_mm.staged.record import RECORD_KEY, describe_linear_vit
    if vit is None:
        vit = build_release_vit(converted)
        load_linear_release(vit, converted)
    state = OrderedDict((f'backbone.{key}', value) for key, value in converted.backbone.items())
    state.update(converted.head)
    record = dict(backbones={'backbone.': describe_linear_vit(vit)},
                  converted_from=dict(release=converted.release.name,
                                      repository=converted.release.repository,
                                      model=converted.model_cfg))
    return dict(state_dict=state, meta={RECORD_KEY: record})
