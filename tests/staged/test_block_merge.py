"""merge_aligned_blocks: attention-alignment jobs of disjoint block sets become one."""
import copy

import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import RECORD_KEY, describe_linear_vit, merge_aligned_blocks
from linvit_mm.testing.staged import tiny_vit_cfg


@pytest.fixture(scope='module')
def base():
    torch.manual_seed(0)
    return MODELS.build(tiny_vit_cfg('relu'))


def job(base, trained, stage='align-attn', shift=1.0):
    """A job's checkpoint: ``base`` with the attention of ``trained`` blocks moved."""
    state = {f'backbone.{k}': v.clone() for k, v in base.state_dict().items()}
    for index in trained:
        for key in state:
            if key.startswith(f'backbone.layers.{index}.attn.'):
                state[key] += shift * (index + 1)
    record = dict(backbones={'backbone.': describe_linear_vit(base)}, stage=stage,
                  trained_layers=list(trained))
    return dict(state_dict=state, meta={RECORD_KEY: record})


def test_merge_aligned_blocks_takes_each_block_from_its_job(base):
    merged = merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': job(base, [1])})
    expected = job(base, [0, 1, 2])['state_dict']
    assert set(merged['state_dict']) == set(expected)
    for key, value in expected.items():
        assert torch.equal(merged['state_dict'][key], value), key
    record = merged['meta'][RECORD_KEY]
    assert record['trained_layers'] == [0, 1, 2] and record['merged_from'] == ['a.pth', 'b.pth']


def test_merge_aligned_blocks_refuses_overlap_and_gaps_naming_blocks(base):
    with pytest.raises(ValueError) as info:
        merge_aligned_blocks({'a.pth': job(base, [0, 1]), 'b.pth': job(base, [1])})
    assert 'block 1 is trained in more than one checkpoint: a.pth, b.pth' in str(info.value)
    assert 'blocks 2 are trained in none of the checkpoints' in str(info.value)


def test_merge_aligned_blocks_of_a_hybrid_leaves_its_softmax_blocks_out():
    torch.manual_seed(0)
    hybrid = MODELS.build(tiny_vit_cfg(dict(default='relu', softmax=[1])))
    merged = merge_aligned_blocks({'a.pth': job(hybrid, [0]), 'b.pth': job(hybrid, [2])})
    assert merged['meta'][RECORD_KEY]['trained_layers'] == [0, 2]
    with pytest.raises(ValueError, match='blocks 2 are trained in none'):
        merge_aligned_blocks({'a.pth': job(hybrid, [0]), 'b.pth': job(hybrid, [1])})


def test_merge_aligned_blocks_refuses_mismatched_jobs(base):
    other = job(base, [1])
    other['state_dict']['backbone.layers.0.ffn.layers.1.bias'] += 1
    with pytest.raises(ValueError, match=r"b.pth and a.pth differ outside the trained "
                                         r"attention .*layers.0.ffn.layers.1.bias"):
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': other})
    feat = job(base, [1], stage='align-feat')
    no_record = job(base, [1])
    del no_record['meta'][RECORD_KEY]
    with pytest.raises(ValueError) as info:
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': feat, 'c.pth': no_record})
    assert "b.pth: not an attention-alignment checkpoint (stage 'align-feat'" in str(info.value)
    assert 'c.pth: not an attention-alignment checkpoint (no record' in str(info.value)
    elu = job(base, [1])
    elu['meta'][RECORD_KEY]['backbones']['backbone.']['attn_types'] = ['elu'] * 3
    with pytest.raises(ValueError, match='b.pth holds another ViT than a.pth'):
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': elu})
    with pytest.raises(ValueError, match='at least two checkpoints'):
        merge_aligned_blocks({'a.pth': job(base, [0, 1, 2])})
    fewer = copy.deepcopy(job(base, [1]))
    del fewer['state_dict']['backbone.ln1.bias']
    with pytest.raises(ValueError, match=r"hold different tensors .*'backbone.ln1.bias'"):
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': fewer})


@pytest.mark.parametrize('value', [float('nan'), float('inf')], ids=['nan', 'inf'])
def test_merge_aligned_blocks_refuses_a_job_holding_non_finite_values(base, value):
    bad = job(base, [1])
    bad['state_dict']['backbone.layers.1.attn.proj.weight'][2, 3] = value
    with pytest.raises(ValueError, match=r'b\.pth: 1 tensor\(s\) hold non-finite values') as info:
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': bad})
    assert 'backbone.layers.1.attn.proj.weight: 1 ' in str(info.value)


@pytest.mark.parametrize('more_first', [False, True], ids=['second-has-more', 'first-has-more'])
def test_jobs_holding_different_tensors_are_named_by_five_keys_at_most(base, more_first):
    more = job(base, [1] if not more_first else [0, 2])
    for i in range(6):
        more['state_dict'][f'backbone.extra{i}'] = torch.zeros(1)
    plain = job(base, [0, 2] if not more_first else [1])
    jobs = {'a.pth': more, 'b.pth': plain} if more_first else {'a.pth': plain, 'b.pth': more}
    with pytest.raises(ValueError) as info:
        merge_aligned_blocks(jobs)
    extra = [f'backbone.extra{i}' for i in range(5)]
    in_b, in_a = ([], extra) if more_first else (extra, [])
    assert (f'b.pth and a.pth hold different tensors (only in b.pth: {in_b}; only in a.pth: '
            f'{in_a})') in str(info.value)


def test_a_trained_block_beyond_the_depth_is_refused(base):
    beyond = job(base, [1])
    beyond['meta'][RECORD_KEY]['trained_layers'] = [1, 3]
    with pytest.raises(ValueError, match=r'b\.pth records trained blocks \[3\] outside the 3 '
                                         r'blocks'):
        merge_aligned_blocks({'a.pth': job(base, [0, 2]), 'b.pth': beyond})
