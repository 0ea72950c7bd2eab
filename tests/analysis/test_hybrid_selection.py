"""linvit_mm.analysis.hybrid_selection: DtR's greedy pass against brute force, the pair and
budget checks, the attention swap and its evaluator on a 4-block model over the mini
ImageNet set, and the hybrid's layout, weights and config."""
from itertools import combinations

import pytest
import torch
from mmengine.config import Config

from linvit_mm.analysis import (AttentionSwap, Evaluator, best_subsets, build_hybrid,
                                build_teacher, check_budget, check_pair, cost_key,
                                criterion_delta, greedy_replace, hybrid_attn_type,
                                hybrid_config_text, hybrid_state, load_config, load_student,
                                validation_batches)

ARCH4 = dict(embed_dims=32, num_layers=4, num_heads=2, feedforward_channels=64)
NUM_IMAGES = 24


# ------------------------------------------------------------------ the greedy pass alone
def additive(weights):
    """Scores whose loss is the sum of the weights of the blocks made linear: removing a
    block costs its weight whatever else was removed, so the greedy pass (lightest block
    first) is provably optimal for every budget."""
    return lambda softmax: dict(loss=sum(w for i, w in enumerate(weights) if i not in softmax))


@pytest.mark.parametrize('weights', [(3., 1., 4., 1.5), (0.2, 5., 0.1, 2.), (1., 1., 1., 1.)],
                         ids=['a', 'b', 'ties'])
def test_greedy_pass_equals_brute_force_where_greedy_is_optimal(weights):
    evaluate, cost = additive(weights), cost_key('loss')
    steps = greedy_replace(range(4), evaluate, cost, budget=0)
    assert [len(step['softmax']) for step in steps] == [4, 3, 2, 1, 0]
    for step in steps:
        size = len(step['softmax'])
        best_cost, best = best_subsets(range(4), evaluate, cost, size)[0]
        assert cost(step['score']) == best_cost
        if len(set(weights)) == len(weights):  # a unique optimum: the same blocks
            assert tuple(step['softmax']) == best
    # ties go to the lower block index
    if weights == (1., 1., 1., 1.):
        assert [step['replaced'] for step in steps[1:]] == [0, 1, 2, 3]


def test_greedy_pass_stops_at_the_budget_and_refuses_impossible_ones():
    steps = greedy_replace(range(4), additive((3., 1., 4., 1.5)), cost_key('loss'), budget=2)
    assert steps[-1]['softmax'] == [0, 2] and len(steps) == 3
    assert set(steps[1]['trials']) == {0, 1, 2, 3} and set(steps[2]['trials']) == {0, 2, 3}
    with pytest.raises(ValueError, match='budget 5 is outside 0..4'):
        greedy_replace(range(4), additive((1, 1, 1, 1)), cost_key('loss'), 5)


def test_criteria():
    score = dict(loss=.5, accuracy=80., relmse=.01)
    assert cost_key('loss')(score) == (.5, )
    assert cost_key('accuracy')(score) == (-80., .5)
    assert cost_key('fidelity')(score) == (.01, )
    with pytest.raises(ValueError, match="unknown criterion 'speed'"):
        cost_key('speed')


@pytest.mark.parametrize('criterion, delta', [('loss', .25), ('accuracy', -5.),
                                              ('fidelity', .02)])
def test_criterion_delta(criterion, delta):
    start, score = dict(loss=.5, accuracy=80., relmse=.01), dict(loss=.75, accuracy=75.,
                                                                 relmse=.03)
    assert criterion_delta(criterion, score, start) == pytest.approx(delta)


def test_brute_force_lists_every_subset():
    ranked = best_subsets(range(4), additive((3., 1., 4., 1.5)), cost_key('loss'), 2)
    assert len(ranked) == len(list(combinations(range(4), 2)))
    assert ranked[0][1] == (0, 2)


# ------------------------------------------------------------------ checks
def test_pairs_that_cannot_be_swapped_are_refused_naming_each_problem(tiny_vit):
    from linvit_mm.models import LinearViT
    student = tiny_vit(dict(default='relu', softmax=[1]))
    wide = dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=64)
    teacher = LinearViT(arch=wide, attn_type='elu', img_size=32, patch_size=16)
    with pytest.raises(ValueError) as info:
        check_pair(student, teacher)
    message = str(info.value)
    assert message.startswith('the teacher does not fit the student:\n  - ')
    for part in ("the teacher's attention is ['elu'], not Softmax: the pass starts from the "
                 'all-Softmax model',
                 'the student already has Softmax attention in blocks [1]',
                 'width (embed_dims) differs',
                 'the student cuts 8x8-pixel patches, the teacher 16x16'):
        assert part in message


def test_a_teacher_of_another_depth_is_refused(tiny_vit):
    with pytest.raises(ValueError, match='the student has 4 blocks, the teacher 2'):
        check_pair(tiny_vit('relu', arch=ARCH4), tiny_vit('softmax'))


def test_a_fitting_pair_passes_without_an_init_cfg(tiny_vit):
    check_pair(tiny_vit('relu'), tiny_vit('softmax'))  # weights loaded before the check


@pytest.mark.parametrize('budget, depth, ok', [(1, 4, True), (3, 4, True), (0, 4, False),
                                               (4, 4, False)])
def test_budget(budget, depth, ok):
    if ok:
        check_budget(budget, depth)
    else:
        with pytest.raises(ValueError, match=f'--budget {budget}: a hybrid of the {depth} '
                                             f'blocks keeps 1 to {depth - 1} Softmax blocks'):
            check_budget(budget, depth)


def test_swap_puts_the_teacher_s_operators_in_and_back(tiny_vit):
    student, teacher = tiny_vit('relu'), tiny_vit('softmax')
    linear = [layer.attn for layer in student.layers]
    swap = AttentionSwap(student, teacher)
    swap.set({1})
    assert student.layers[1].attn is teacher.layers[1].attn
    assert student.layers[0].attn is linear[0]
    swap.restore()
    assert [layer.attn for layer in student.layers] == linear


# ------------------------------------------------------------------ on the mini set
@pytest.fixture
def pair(make_student, teacher4_ckpt):
    """A 4-block relu classifier with the teacher's blocks, its teacher and validation
    batches of 24 images."""
    config, checkpoint = make_student('relu', teacher4_ckpt, arch=ARCH4)
    cfg = load_config(str(config))
    model = load_student(cfg, str(checkpoint), 'cpu')
    teacher, _ = build_teacher(cfg)
    batches, count = validation_batches(cfg, model, NUM_IMAGES, 16, 'cpu')
    assert count == NUM_IMAGES and [len(labels) for _, labels in batches] == [16, 8]
    return cfg, model, teacher, batches


def test_validation_images_are_spread_over_the_set(pair):
    labels = torch.cat([labels for _, labels in pair[3]])
    assert torch.bincount(labels).tolist() == [4] * 6


def test_evaluator_scores_against_the_all_softmax_configuration(pair):
    cfg, model, teacher, batches = pair
    evaluator = Evaluator(model, AttentionSwap(model.backbone, teacher), batches)
    score = evaluator({0, 1})
    assert evaluator.calls == 2  # the all-Softmax reference first
    assert evaluator({1, 0}) is score and evaluator.calls == 2
    assert 0 < score['relmse'] and score['cos'] < 1
    assert [layer.attn.attn_type for layer in model.backbone.layers] == ['relu'] * 4
    # the all-linear configuration is the student as it is
    linear = evaluator(set())
    with torch.no_grad():
        logits = torch.cat([model(inputs, mode='tensor') for inputs, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert linear['loss'] == pytest.approx(
        torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    assert linear['accuracy'] == pytest.approx(
        100. * (logits.argmax(-1) == labels).float().mean().item())


def test_every_step_keeps_the_replacement_that_hurts_least(pair):
    """The greedy invariant, checked at each step with fresh evaluations of every candidate
    (the real model and scores: greedy is not provably optimal here)."""
    cfg, model, teacher, batches = pair
    swap = AttentionSwap(model.backbone, teacher)
    cost = cost_key('loss')
    steps = greedy_replace(range(4), Evaluator(model, swap, batches), cost)
    for before, after in zip(steps, steps[1:]):
        fresh = Evaluator(model, swap, batches)
        candidates = {block: cost(fresh(set(before['softmax']) - {block}))
                      for block in before['softmax']}
        assert after['replaced'] == min(candidates, key=lambda b: (candidates[b], b))
        assert set(after['softmax']) == set(before['softmax']) - {after['replaced']}
    # all-Softmax is the teacher with the student's stem, MLPs and head: no fidelity loss
    assert steps[0]['score']['relmse'] == 0 and steps[0]['score']['cos'] == pytest.approx(1)


# ------------------------------------------------------------------ the hybrid
@pytest.mark.parametrize('attn_type, layout, with_cls_token', [
    ('relu', {'default': 'relu', 'softmax': [0, 2]}, None),
    ('mhla', {'default': 'mhla', 'softmax': [0, 2]}, False),
], ids=['relu-convention-agrees', 'mhla-written'])
def test_hybrid_attn_type(tiny_vit, attn_type, layout, with_cls_token):
    student = tiny_vit(attn_type, arch=ARCH4)
    assert hybrid_attn_type(student, [0, 2]) == (layout, with_cls_token)


def test_hybrid_weights_config_and_model(pair, tmp_path):
    cfg, model, teacher, batches = pair
    state = hybrid_state(model, 'backbone', teacher, [1])
    assert torch.equal(state['backbone.layers.1.attn.qkv.weight'],
                       teacher.state_dict()['layers.1.attn.qkv.weight'])
    assert torch.equal(state['backbone.layers.0.attn.qkv.weight'],
                       model.state_dict()['backbone.layers.0.attn.qkv.weight'])
    head = 'head.layers.head.weight'
    assert torch.equal(state[head], model.state_dict()[head])
    layout, with_cls_token = hybrid_attn_type(model.backbone, [1])
    hybrid = build_hybrid(cfg, 'backbone', layout, with_cls_token, state)
    assert hybrid.backbone.attn_types == ['relu', 'softmax', 'relu', 'relu']
    incomplete = {k: v for k, v in state.items() if not k.startswith('backbone.layers.1.attn.')}
    with pytest.raises(RuntimeError, match='Missing key'):
        build_hybrid(cfg, 'backbone', layout, with_cls_token, incomplete)

    out = tmp_path / 'out'
    out.mkdir()
    text = hybrid_config_text(cfg.filename, 'student.pth', 'backbone', layout, with_cls_token,
                              str(out), 1, 'loss', NUM_IMAGES, dict(loss=.5, accuracy=75.))
    assert 'keeps Softmax attention in blocks [1] (budget 1, criterion loss,' in text
    (out / 'hybrid_config.py').write_text(text)
    written = Config.fromfile(str(out / 'hybrid_config.py'))
    assert written.model.backbone.attn_type == layout
    assert written.model.backbone.arch == ARCH4  # the rest comes from the base
    assert written.load_from == str(out / 'hybrid.pth')
