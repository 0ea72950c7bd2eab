"""Softmax attention: fused and eager forms, the map, attention dropout."""
import pytest
import torch

from linvit_mm.testing import assert_rel_close, rel_error


def test_map_rows_are_distributions(make_attention, tokens):
    module = make_attention('softmax')
    hw = (7, 9)
    with torch.no_grad():
        attn = module.attention_map(tokens(hw, 1), hw)
    assert attn.min() >= 0
    assert_rel_close(attn.sum(dim=-1), torch.ones(attn.shape[:-1], dtype=attn.dtype), 1e-12,
                     'row sums')


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
def test_fused_matches_eager_float32(training, make_attention, tokens, output_and_grads):
    module = make_attention('softmax', dtype=torch.float32)
    module.train(training)
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    module.fused = True
    fused, fused_grads = output_and_grads(module, lambda t: module(t, hw), x)
    module.fused = False
    eager, eager_grads = output_and_grads(module, lambda t: module(t, hw), x)
    assert_rel_close(fused, eager, 1e-5, 'output')
    for name, grad in fused_grads.items():
        assert_rel_close(grad, eager_grads[name], 1e-5, f'grad of {name}')


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'eager'])
def test_attention_dropout_only_in_training(fused, make_attention, tokens):
    module = make_attention('softmax', dtype=torch.float32, attn_drop=0.5, fused=fused)
    hw = (5, 3)
    x = tokens(hw, 1, dtype=torch.float32)
    module.eval()
    first, second = module(x, hw), module(x, hw)
    assert torch.equal(first, second)
    module.train()
    torch.manual_seed(3)
    dropped = module(x, hw)
    assert rel_error(dropped, first) > 1e-2
    # the map is the attention distribution before dropout, in training too
    assert torch.equal(module.attention_map(x, hw), module.eval().attention_map(x, hw))
