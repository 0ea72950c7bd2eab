"""The strict-state check (linvit_mm.utils.checkpoint_state), by value."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.testing.staged import tiny_vit_cfg
from linvit_mm.utils.checkpoint_state import resizable_pos_embed, state_problems


@pytest.fixture(scope='module')
def vit():
    # learned pos_embed over a 4 x 4 grid after one class-token slot, width 32
    return MODELS.build(tiny_vit_cfg('relu'))


@pytest.mark.parametrize('shape, resizable', [
    ((1, 1 + 64, 32), True), ((1, 1 + 4, 32), True), ((1, 1 + 16, 32), True),
    ((1, 1 + 15, 32), False), ((1, 1, 32), False), ((1, 65, 16), False),
    ((2, 65, 32), False), ((1, 65), False)],
    ids=['8x8', '2x2', 'same-grid', 'not-square', 'no-patches', 'other-width', 'batch-2',
         'two-dims'])
def test_resizable_pos_embed(vit, shape, resizable):
    assert resizable_pos_embed(vit, torch.zeros(shape)) is resizable


def test_no_learned_pos_embed_nothing_resizes():
    sincos = MODELS.build(tiny_vit_cfg('relu', pos_embed_type='sincos'))
    assert sincos.pos_embed is None
    # neither with nor without an extra-token slot
    assert not resizable_pos_embed(sincos, torch.zeros(1, 64, 32))
    assert not resizable_pos_embed(sincos, torch.zeros(1, 65, 32))


def test_a_fitting_state_has_no_problem(vit):
    assert state_problems(vit.state_dict(), dict(vit.state_dict())) == []


def test_each_kind_of_problem_is_one_line_naming_its_keys(vit):
    expected = vit.state_dict()
    state = dict(expected)
    del state['layers.1.ln2.bias']
    state['layers.0.attn.extra'] = torch.zeros(1)
    state['layers.2.ln1.weight'] = torch.zeros(7)
    state['pos_embed'] = torch.zeros(1, 65, 32)  # another square grid: resampled on load
    assert state_problems(expected, state, 'backbone.', vits={'': vit}) == [
        'missing keys (the model has them, the checkpoint not): backbone.layers.1.ln2.bias',
        'unexpected keys (in the checkpoint, not in the model): backbone.layers.0.attn.extra',
        'size-mismatched keys: backbone.layers.2.ln1.weight: checkpoint (7,), model (32,)']
    # without the ViT named, a pos_embed of another grid is a mismatch like any other
    problems = state_problems(expected, state, vits={'other.': vit}, against='config')
    assert problems[-1].endswith('; pos_embed: checkpoint (1, 65, 32), config (1, 17, 32)')


def test_the_pos_embed_is_found_by_the_vits_key_prefix(vit):
    expected = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state = dict(expected, **{'backbone.pos_embed': torch.zeros(1, 5, 32)})
    assert state_problems(expected, state, vits={'backbone.': vit}) == []
    state['backbone.pos_embed'] = torch.zeros(1, 5, 16)
    assert state_problems(expected, state, vits={'backbone.': vit}) == [
        'size-mismatched keys: backbone.pos_embed: checkpoint (1, 5, 16), model (1, 17, 32)']


def test_long_lists_are_cut_after_twenty_keys():
    expected = {f'k{i:02d}': torch.zeros(1) for i in range(25)}
    state = {f'k{i:02d}': torch.zeros(2) for i in range(3, 25)}
    state.update({f'x{i:02d}': torch.zeros(1) for i in range(21)})
    missing, unexpected, mismatched = state_problems(expected, state)
    assert missing == 'missing keys (the model has them, the checkpoint not): k00, k01, k02'
    assert unexpected.endswith(', x19 and 1 more') and 'x20' not in unexpected
    assert mismatched.endswith('k22: checkpoint (2,), model (1,) and 2 more')
    assert mismatched.count('checkpoint (2,)') == 20


def test_entries_without_a_shape_are_compared_by_name_only():
    assert state_problems({'a': torch.zeros(2), 'b': 3}, {'a': torch.zeros(2), 'b': 'x'}) == []
