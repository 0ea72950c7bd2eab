"""What a checkpoint's tensors do not say is said: unknown tensors are listed at WARNING
level, an integer weight is refused by name, a CLIP checkpoint's MLP activation is warned
about."""
import dataclasses
import logging
from collections import OrderedDict

import pytest
import torch

from linvit_mm.models import LinearViT
from linvit_mm.transfer import load_softmax_checkpoint, transfer_softmax_weights


@pytest.fixture
def capture(caplog):
    """A logger for the transfer whose WARNING records the test reads."""
    logger = logging.getLogger('transfer_warnings_test')
    caplog.set_level(logging.INFO, logger=logger.name)
    return logger, caplog


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_unknown_tensors_are_listed_at_warning_level(build, timm_sd, capture):
    logger, caplog = capture
    checkpoint = OrderedDict(timm_sd)
    checkpoint['blocks.0.attn.extra_scale'] = torch.ones(3)
    checkpoint['blocks.5.gate'] = torch.ones(1)
    checkpoint['mystery'] = torch.ones(2)
    checkpoint['dist_token'] = torch.zeros(1, 1, 192)   # known: left out with a reason
    report = transfer_softmax_weights(build('relu'), checkpoint, setting='fullcopy',
                                      num_heads=3, logger=logger)
    assert report['unknown in checkpoint'] == ['blocks.0.attn.extra_scale', 'blocks.5.gate',
                                               'mystery']
    unknown, = [w for w in warnings_of(caplog) if 'unknown to the transfer' in w]
    assert "blocks.0.attn.extra_scale (inside block 0's attention)" in unknown
    assert 'blocks.5.gate (inside block 5)' in unknown and '\n  mystery' in unknown
    assert 'dist_token' not in unknown
    table = next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert 'unknown in checkpoint, not copied: blocks.0.attn.extra_scale' in table


def test_a_checkpoint_without_unknown_tensors_warns_nothing(build, timm_sd, capture):
    logger, caplog = capture
    report = transfer_softmax_weights(build('relu'), timm_sd, setting='fullcopy', num_heads=3,
                                      logger=logger)
    assert report['unknown in checkpoint'] == [] and warnings_of(caplog) == []


@pytest.mark.parametrize('dtype', [torch.int64, torch.bool], ids=str)
def test_an_integer_weight_is_refused_by_name(timm_sd, dtype):
    checkpoint = OrderedDict(timm_sd)
    checkpoint['blocks.1.mlp.fc1.weight'] = checkpoint['blocks.1.mlp.fc1.weight'].to(dtype)
    with pytest.raises(ValueError, match=r'backbone\.layers\.1\.ffn\.layers\.0\.0\.weight '
                       rf'\(blocks\.1\.mlp\.fc1\.weight\): {dtype}'):
        load_softmax_checkpoint(checkpoint)


def test_an_integer_weight_of_a_read_checkpoint_is_not_cast(build, timm_sd, refuses):
    ckpt = load_softmax_checkpoint(timm_sd, num_heads=3)
    state = dict(ckpt.state_dict)
    state['backbone.layers.0.attn.proj.weight'] = state['backbone.layers.0.attn.proj.weight'].to(
        torch.int32)
    message = refuses(build('relu'), dataclasses.replace(ckpt, state_dict=state),
                      setting='copy')
    assert 'backbone.layers.0.attn.proj.weight: torch.int32' in message
    # outside the selection it is not copied, so not refused
    transfer_softmax_weights(build('relu'), dataclasses.replace(ckpt, state_dict=state),
                             setting='mlpcopy')


@pytest.mark.parametrize('word,other', [('clip-base', 'clip-base-gelu'),
                                        ('clip-base-gelu', 'clip-base')])
@pytest.mark.parametrize('layout', ['timm', 'release'])
def test_a_clip_mlp_copy_warns_that_the_activation_is_unknown(word, other, layout, timm_source,
                                                             release, arch_of, capture):
    logger, caplog = capture
    source = timm_source('clip-base', img_size=32)
    checkpoint = source.state_dict()
    if layout == 'release':
        checkpoint = release('clip-base', checkpoint)
    model = LinearViT(arch=arch_of(word, source), attn_type='relu', img_size=32)
    transfer_softmax_weights(model, checkpoint, setting='mlpcopy', num_heads=4, logger=logger)
    warning, = [w for w in warnings_of(caplog) if 'activation' in w]
    used = 'QuickGELU' if word == 'clip-base' else 'GELU'
    assert f'The model uses {used};' in warning and f"arch='{other}'" in warning
    caplog.clear()
    # the attention alone does not depend on the activation
    transfer_softmax_weights(model, checkpoint, setting='copy', num_heads=4, logger=logger)
    assert not [w for w in warnings_of(caplog) if 'activation' in w]
