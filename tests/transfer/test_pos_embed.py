"""How a checkpoint's position embedding is laid out for the model: which leading slots are
kept, dropped or added, in which order, and the refusals when it cannot be."""
from collections import OrderedDict

import pytest
import timm
import torch
from mmpretrain.models.utils import resize_pos_embed
from timm.models.vision_transformer import VisionTransformer

from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.transfer import transfer_softmax_weights

WIDTH, PATCH, IMG = 32, 8, 32  # a 4x4 grid
GRID = (IMG // PATCH) ** 2
SIZES = dict(embed_dims=WIDTH, num_layers=1, num_heads=2, feedforward_channels=64,
             patch_size=PATCH)


def distinct(state):
    """``state`` with every slot of its position embedding drawn anew: a slot kept in the
    wrong place then shows."""
    state = OrderedDict(state)
    generator = torch.Generator().manual_seed(5)
    state['pos_embed'] = torch.randn(state['pos_embed'].shape, generator=generator)
    return state


def timm_vit(img_size=IMG, **kwargs):
    torch.manual_seed(0)
    return distinct(VisionTransformer(img_size=img_size, patch_size=PATCH, embed_dim=WIDTH,
                                      depth=1, num_heads=2, num_classes=0, **kwargs).state_dict())


def distilled_deit():
    torch.manual_seed(0)
    return distinct(timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False,
                                      img_size=IMG, patch_size=PATCH, embed_dim=WIDTH, depth=1,
                                      num_heads=2).state_dict())


# name -> (checkpoint, its leading slots in order)
SOURCES = {
    # a class token and four registers, each with a slot (timm reg_tokens, embed_class)
    'registers': (lambda: timm_vit(reg_tokens=4), ['cls', 'reg', 'reg', 'reg', 'reg']),
    # DeiT distilled: [class, distillation] slots
    'deit-distilled': (distilled_deit, ['cls', 'dist']),
    'class-token': (timm_vit, ['cls']),
    # DeiT III / timm no_embed_class: no slot for the class token
    'no-class-slot': (lambda: timm_vit(no_embed_class=True), []),
}


@pytest.fixture(scope='module')
def source_states():
    return {name: make() for name, (make, _) in SOURCES.items()}


def vit(with_cls_token, img_size=IMG, **switches):
    torch.manual_seed(3)
    return LinearViT(arch=dict(SIZES, **switches), img_size=img_size, attn_type='softmax',
                     with_cls_token=with_cls_token, pos_embed_type='learned',
                     out_type='cls_token' if with_cls_token else 'avg_featmap')


# (source, model keeps a class token, the note the copy leaves or None)
CASES = [
    ('registers', True, 'dropped 4 leading slot(s) the model has no token for'),
    ('registers', False, 'dropped 5 leading slot(s) the model has no token for'),
    ('deit-distilled', True, None),
    ('deit-distilled', False, 'dropped 1 leading slot(s) the model has no token for'),
    ('class-token', False, 'dropped 1 leading slot(s) the model has no token for'),
    ('class-token', True, None),
    ('no-class-slot', True, "added 1 zero slot(s) for the model's leading tokens the "
                            'checkpoint gives no position embedding'),
]


@pytest.mark.parametrize('source,with_cls,note', CASES,
                         ids=[f'{s}-into-{"cls" if c else "no-cls"}' for s, c, _ in CASES])
def test_the_class_slot_and_the_patch_grid_are_kept_in_order(source, with_cls, note,
                                                           source_states, state):
    checkpoint = source_states[source]
    slots = SOURCES[source][1]
    pos = checkpoint['pos_embed']
    assert pos.shape[1] == len(slots) + GRID
    grid = pos[:, len(slots):]
    if not with_cls:
        expected = grid
    elif 'cls' in slots:
        expected = torch.cat([pos[:, slots.index('cls'):slots.index('cls') + 1], grid], 1)
    else:
        expected = torch.cat([torch.zeros(1, 1, WIDTH), grid], 1)

    model = vit(with_cls)
    before = state(model)
    report = transfer_softmax_weights(model, checkpoint, components=['pos_embed'])
    assert report['copied'] == ['pos_embed']
    assert torch.equal(model.pos_embed.detach(), expected)
    after = state(model)
    for name in before:
        if name != 'pos_embed':
            assert torch.equal(after[name], before[name]), name
    pos_notes = [text for text in report['notes'] if text.startswith('pos_embed: ')]
    assert pos_notes == ([f'pos_embed: {note}'] if note else [])
    if source == 'deit-distilled':
        assert any('dropped the distillation-token slot' in text for text in report['notes'])


@pytest.mark.parametrize('src_img,img,antialias', [(32, 48, False), (48, 32, True)],
                         ids=['4x4-to-6x6', '6x6-to-4x4-antialiased'])
def test_slots_are_dropped_before_the_grid_is_resized(src_img, img, antialias):
    """A register source into a class-token model of another grid: the class slot and the
    patch grid, resampled as the model resamples its own embedding (antialiased when
    shrinking, for a model built so)."""
    checkpoint = timm_vit(img_size=src_img, reg_tokens=4)
    src, dst = (src_img // PATCH, ) * 2, (img // PATCH, ) * 2
    pos = checkpoint['pos_embed']
    model = vit(True, img_size=img, pos_embed_antialias=antialias)
    report = transfer_softmax_weights(model, checkpoint, components=['pos_embed'])
    kept = torch.cat([pos[:, :1], pos[:, 5:]], 1)
    expected = model._resample_pos_embed(kept, src, dst)
    assert torch.equal(model.pos_embed.detach(), expected)
    if antialias:
        assert not torch.allclose(expected, resize_pos_embed(kept, src, dst, 'bicubic', 1))
    assert (f'pos_embed: dropped 4 leading slot(s) the model has no token for; resized from '
            f'{src[0]}x{src[1]} to {dst[0]}x{dst[1]} (bicubic)') in report['notes']


def test_a_backbone_without_its_own_resampling_uses_mmpretrains(source_states):
    """mmpretrain's VisionTransformer has no ``_resample_pos_embed``: its own
    ``resize_pos_embed`` with the model's interpolation mode and extra tokens."""
    from mmpretrain.models import VisionTransformer as MMViT
    torch.manual_seed(3)
    model = MMViT(arch=dict(embed_dims=WIDTH, num_layers=1, num_heads=2,
                            feedforward_channels=64), img_size=48, patch_size=PATCH,
                  interpolate_mode='bilinear')
    pos = source_states['class-token']['pos_embed']
    report = transfer_softmax_weights(model, source_states['class-token'],
                                      components=['pos_embed'])
    assert torch.equal(model.pos_embed.detach(),
                       resize_pos_embed(pos, (4, 4), (6, 6), 'bilinear', 1))
    assert 'pos_embed: resized from 4x4 to 6x6 (bilinear)' in report['notes']


# --------------------------------------------------------------- refusals


class PositionOnly(torch.nn.Module):
    """A module with a learned position embedding that does not say both its patch grid and
    its extra-token slots."""

    def __init__(self, slots, **says):
        super().__init__()
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, slots, WIDTH))
        for name, value in says.items():
            setattr(self, name, value)


def listed(message):
    """The misfit lines of a refusal, each naming one tensor; the only one here."""
    lines = [line.strip() for line in message.splitlines()]
    assert lines[1] == '1 tensor(s) differ in shape, the first:'
    return lines[2:3]


def test_an_embedding_that_cannot_be_laid_out_is_refused(source_states, refuses):
    checkpoint = source_states['class-token']
    narrow = OrderedDict(checkpoint, pos_embed=checkpoint['pos_embed'][..., :WIDTH // 2])
    message = refuses(vit(True), narrow, components=['pos_embed'])
    assert (f'backbone.pos_embed: checkpoint (1, 17, {WIDTH // 2}) vs model (1, 17, {WIDTH}) '
            f'(embedding widths differ)') in listed(message)

    for says in ({}, dict(num_extra_tokens=1), dict(patch_resolution=(3, 3))):
        message = refuses(PositionOnly(10, **says), checkpoint, components=['pos_embed'])
        assert (f'backbone.pos_embed: checkpoint (1, 17, {WIDTH}) vs model (1, 10, {WIDTH}) (the '
                f'model does not say its patch grid (patch_resolution))') in listed(message), says

    model = vit(True, img_size=48)
    model.pos_embed = torch.nn.Parameter(torch.zeros(1, 1 + 5 * 5, WIDTH))  # not its 6x6 grid
    message = refuses(model, checkpoint, components=['pos_embed'])
    assert (f'backbone.pos_embed: checkpoint (1, 17, {WIDTH}) vs model (1, 26, {WIDTH}) (the '
            f'model pos_embed does not match its own patch grid)') in listed(message)

    oblong = OrderedDict(checkpoint, pos_embed=torch.zeros(1, 1 + 4 * 3, WIDTH))
    message = refuses(vit(True), oblong, components=['pos_embed'])
    assert (f'backbone.pos_embed: checkpoint (1, 13, {WIDTH}) vs model (1, 17, {WIDTH}) (the '
            f'checkpoint position embedding is not extra tokens plus a square '
            f'grid)') in listed(message)


def test_a_model_with_register_slots_gets_zero_slots_for_the_tokens_the_checkpoint_lacks(
        source_states):
    """A class-token checkpoint into a ViT whose embedding has a slot for its class token and
    each of four registers: the class slot is the checkpoint's, the four others zeros."""
    model = vit(True, num_register_tokens=4)
    assert model.pos_embed_extra_tokens == 5
    source = source_states['class-token']
    report = transfer_softmax_weights(model, source, components=['pos_embed'])
    assert ("pos_embed: added 4 zero slot(s) for the model's leading tokens the checkpoint "
            'gives no position embedding') in report['notes']
    pos = model.pos_embed.detach()
    assert torch.equal(pos[0, 0], source['pos_embed'][0, 0])
    assert torch.equal(pos[0, 1:5], torch.zeros(4, WIDTH))
    assert torch.equal(pos[0, 5:], source['pos_embed'][0, 1:])


def test_the_position_embedding_alone_needs_no_blocks_of_the_same_depth(source_states):
    model = vit(True, num_layers=3)
    report = transfer_softmax_weights(model, source_states['class-token'],
                                      components=['pos_embed'])
    assert report['copied'] == ['pos_embed']
