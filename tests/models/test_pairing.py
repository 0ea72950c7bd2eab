"""The student-teacher pairing rules (linvit_mm.models.pairing), by value and by refusal."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.models import pairing
from linvit_mm.models.pairing import TokenLayout
from linvit_mm.testing.staged import TINY_ARCH, tiny_vit_cfg

WEIGHTS = dict(type='Pretrained', checkpoint='teacher.pth')  # never read: nothing is loaded


def vit(attn_type='relu', **overrides):
    return MODELS.build(tiny_vit_cfg(attn_type, **overrides))


def teacher(attn_type='softmax', **overrides):
    return vit(attn_type, **dict(dict(init_cfg=WEIGHTS), **overrides))


def blocks_of(attn_type):
    return pairing.attention_modules(vit(attn_type))


# ------------------------------------------------------------------ compared blocks
@pytest.mark.parametrize('attn_type, layers, blocks, skipped', [
    pytest.param('relu', None, [0, 1, 2], [], id='linear-student-every-block'),
    pytest.param(['relu', 'softmax', 'elu'], None, [0, 2], [1], id='hybrid-skips-softmax'),
    pytest.param(['softmax', 'relu', 'softmax'], None, [1], [0, 2], id='hybrid-one-linear'),
    pytest.param('softmax', None, [0, 1, 2], [], id='softmax-student-every-block'),
    pytest.param(['relu', 'softmax', 'elu'], [1], [1], [], id='softmax-block-listed'),
    pytest.param('relu', [2, 0], [0, 2], [], id='listed-sorted'),
    pytest.param('relu', [-1], [2], [], id='negative-from-the-end'),
    pytest.param('relu', [-3, 2], [0, 2], [], id='both-ends'),
])
def test_resolve_layers(attn_type, layers, blocks, skipped):
    assert pairing.resolve_layers(blocks_of(attn_type), layers) == (blocks, skipped)


def test_an_all_softmax_student_can_be_refused():
    with pytest.raises(ValueError, match='the student has no linear-attention block to align'):
        pairing.resolve_layers(blocks_of('softmax'), None, 'align', all_softmax='refuse')
    # listed blocks are compared even then
    assert pairing.resolve_layers(blocks_of('softmax'), [1], 'align',
                                  all_softmax='refuse') == ([1], [])


@pytest.mark.parametrize('layers, error, message', [
    ([3], ValueError, r'layers \[3\] are outside the 3 blocks of the student; use indices in '
                      r'\[-3, 2\]'),
    ([0, -4], ValueError, r'layers \[-4\] are outside the 3 blocks'),
    ([1, 1], ValueError, r'layers \[1, 1\] name block\(s\) \[1\] more than once'),
    ([2, -1, 0], ValueError, r'layers \[2, -1, 0\] name block\(s\) \[2\] more than once '
                             r'\(negative indices count from the end of the 3 blocks\)'),
    ([], ValueError, r'layers=\[\] selects no block to distil'),
    ([0.0], TypeError, 'block indices'),
], ids=['past-the-end', 'before-the-start', 'repeated', 'negative-alias', 'empty', 'float'])
def test_resolve_layers_refuses(layers, error, message):
    with pytest.raises(error, match=message):
        pairing.resolve_layers(blocks_of('relu'), layers)


# ------------------------------------------------------------------ fit
def test_a_fitting_pair_has_no_problem():
    assert pairing.fit_problems(vit('relu'), teacher()) == []
    # patch sizes given as an int and as a pair are the same
    assert pairing.fit_problems(vit('relu', patch_size=(8, 8)), teacher()) == []


@pytest.mark.parametrize('student, teacher_overrides, kwargs, expected', [
    pytest.param({}, dict(arch=dict(TINY_ARCH, num_layers=4)), {},
                 ['the student has 3 blocks, the teacher 4: they are compared block for '
                  "block, so build the teacher with the student's arch"], id='depth'),
    pytest.param({}, dict(attn_type='elu'), {},
                 ["the teacher's attention is ['elu'], not Softmax: set its "
                  "attn_type='softmax'"], id='non-softmax'),
    pytest.param({}, dict(attn_type=['softmax', 'relu', 'softmax']),
                 dict(non_softmax_advice='or allow it'),
                 ["the teacher's attention is ['relu'], not Softmax: or allow it"],
                 id='hybrid-teacher'),
    pytest.param({}, dict(init_cfg=None), {},
                 ['the teacher has no init_cfg, so it would keep random weights: give it one '
                  "that loads the Softmax checkpoint (e.g. dict(type='SoftmaxTransfer', "
                  "checkpoint=..., setting='fullcopy'))"], id='no-weights'),
    pytest.param({}, dict(arch=dict(TINY_ARCH, embed_dims=64, feedforward_channels=128)), {},
                 ["the teacher's width (embed_dims) differs from the student's (student vs "
                  "teacher: blocks 0-2: 32 vs 64); build the teacher with the student's arch"],
                 id='width'),
    pytest.param({}, dict(arch=dict(TINY_ARCH, num_heads=4)), dict(blocks=[0, 2]),
                 ["the teacher's head count (num_heads) differs from the student's (student "
                  "vs teacher: blocks 0, 2: 2 vs 4); build the teacher with the student's "
                  'arch'], id='heads-on-the-compared-blocks'),
    pytest.param({}, dict(patch_size=4), {},
                 ['the student cuts 8x8-pixel patches, the teacher 4x4-pixel patches, so '
                  "their tokens do not correspond; set the teacher's patch_size to the "
                  "student's"], id='patch-size'),
    pytest.param({}, dict(attn_type='ttt'), dict(target='map', allow_non_softmax=True),
                 ["target='map' needs attention maps, which the ['ttt'] operator(s) of the "
                  "teacher do not have; use target='output' or a teacher whose operator has "
                  'a map'], id='map-target'),
])
def test_each_misfit_is_one_line(student, teacher_overrides, kwargs, expected):
    assert pairing.fit_problems(vit('relu', **student), teacher(**teacher_overrides),
                                **kwargs) == expected


def test_per_block_traits_are_grouped_by_value():
    student, softmax = vit('relu'), teacher()
    # the check reads each block's operator; set per block as a hybrid of widths would have it
    for index, (have, want) in enumerate([(2, 2), (4, 2), (4, 8)]):
        student.layers[index].attn.num_heads = have
        softmax.layers[index].attn.num_heads = want
    problems = pairing.fit_problems(student, softmax)
    assert problems == ["the teacher's head count (num_heads) differs from the student's "
                        "(student vs teacher: block 1: 4 vs 2; block 2: 4 vs 8); build the "
                        "teacher with the student's arch"]


def test_only_the_compared_blocks_are_checked_and_depths_may_differ():
    narrow = teacher(arch=dict(TINY_ARCH, num_heads=4))
    assert pairing.fit_problems(vit('relu'), narrow, blocks=[]) == []
    deeper = teacher(arch=dict(TINY_ARCH, num_layers=4, num_heads=4))
    problems = pairing.fit_problems(vit('relu'), deeper, blocks=[2, 3])
    # block 3 exists in the teacher only: it is named by the depth line, not compared
    assert len(problems) == 2 and 'blocks 0-2' not in problems[1]
    assert 'block 2: 2 vs 4)' in problems[1]


def test_allowed_flags():
    elu, random = teacher(attn_type='elu'), teacher(init_cfg=None)
    assert pairing.fit_problems(vit('relu'), elu, allow_non_softmax=True) == []
    assert pairing.fit_problems(vit('relu'), random, require_weights=False) == []
    # an output target does not need maps
    assert pairing.fit_problems(vit('relu'), teacher(attn_type='ttt'),
                                allow_non_softmax=True) == []


def test_a_teacher_inside_a_classifier_loads_through_its_backbone():
    classifier = MODELS.build(dict(
        type='ImageClassifier', backbone=tiny_vit_cfg('softmax', init_cfg=WEIGHTS),
        head=dict(type='LinearClsHead', num_classes=3, in_channels=32)))
    assert pairing.fit_problems(vit('relu'), classifier) == []
    classifier.backbone.init_cfg = None
    assert 'no init_cfg' in pairing.fit_problems(vit('relu'), classifier)[0]


def test_the_patch_size_is_compared_only_where_both_declare_one():
    bare = torch.nn.Sequential(vit('relu').layers[0])
    assert pairing.patch_size_of(bare) is None
    assert pairing.fit_problems(bare, teacher(arch=dict(TINY_ARCH, num_layers=1))) == []


def test_refuse_lists_every_problem_or_nothing():
    pairing.refuse([], 'fine')
    with pytest.raises(ValueError) as error:
        pairing.refuse(['one', 'two'], 'the pair does not fit')
    assert str(error.value) == 'the pair does not fit:\n  - one\n  - two'


# ------------------------------------------------------------------ tokens
@pytest.mark.parametrize('overrides, layout, extra, text', [
    (dict(attn_type='relu'), (True, 0), 1, 'class token'),
    (dict(attn_type='mhla'), (False, 0), 0, 'none'),
    (dict(attn_type='relu', num_register_tokens=4), (True, 4), 5, 'class token + 4 register(s)'),
    (dict(attn_type='ttt', num_register_tokens=1), (False, 1), 1, '1 register(s)'),
], ids=['class-token', 'patch-only', 'registers', 'register-no-class-token'])
def test_token_layout(overrides, layout, extra, text):
    model = vit(**overrides)
    found = pairing.token_layout(model)
    assert found == layout and found.num_extra == extra == model.num_extra_tokens
    assert str(found) == text
    # read from the outermost module that declares it (a ViT inside a wrapper)
    assert pairing.token_layout(torch.nn.Sequential(model)) == layout


def test_token_layout_of_a_module_that_declares_no_registers():
    class Backbone(torch.nn.Module):
        with_cls_token = True

    assert pairing.token_layout(Backbone()) == TokenLayout(True, 0)
    Backbone.num_register_tokens = None
    assert pairing.token_layout(Backbone()) == TokenLayout(True, 0)
    assert pairing.token_layout(torch.nn.Linear(2, 2)) is None


CLS, NONE, REG = TokenLayout(True, 0), TokenLayout(False, 0), TokenLayout(False, 1)


@pytest.mark.parametrize('student, teacher_layout, requested, expected', [
    (CLS, CLS, None, False), (CLS, CLS, False, False), (CLS, CLS, True, True),
    (NONE, CLS, None, True), (NONE, CLS, False, True),
    # one extra token each, of different kinds: a class token is never matched with a register
    (CLS, REG, None, True),
    (CLS, TokenLayout(True, 4), None, True),
    (None, CLS, None, True), (CLS, None, None, True), (None, None, None, True),
], ids=['same', 'same-not-requested', 'requested', 'no-class-token', 'not-overridable',
        'cls-vs-register', 'registers', 'student-unknown', 'teacher-unknown', 'both-unknown'])
def test_patch_tokens_only(student, teacher_layout, requested, expected):
    assert pairing.patch_tokens_only(student, teacher_layout, requested) is expected


def test_patch_tokens_only_refuses_a_non_bool():
    with pytest.raises(TypeError, match="patch_tokens_only must be None .* got 'yes'"):
        pairing.patch_tokens_only(CLS, CLS, 'yes')


@pytest.mark.parametrize('student, teacher_layout, fits', [
    (CLS, CLS, True), (NONE, CLS, True), (NONE, TokenLayout(True, 4), True),
    (CLS, NONE, False), (CLS, REG, False), (TokenLayout(True, 4), CLS, False)],
    ids=['same', 'none', 'none-vs-registers', 'extra-vs-none', 'cls-vs-register',
         'registers-vs-cls'])
def test_input_tokens_the_teachers_or_none(student, teacher_layout, fits):
    problems = pairing.input_token_problems(student, teacher_layout)
    assert (problems == []) is fits
    if not fits:
        assert problems[0].startswith(f'the student leads its sequence with '
                                      f'{student.num_extra} extra tokens ({student}), the '
                                      f'teacher with {teacher_layout.num_extra}')


def test_align_tokens_cuts_the_leading_extra_tokens():
    # 20 channels, more than the 16 patches: a cut on the channel axis would show
    student = torch.arange(2 * 17 * 20, dtype=torch.float64).reshape(2, 17, 20)
    teacher = -student
    same = pairing.align_tokens(student, teacher, 16, patch_only=False)
    assert same[0] is student and same[1] is teacher
    s, t = pairing.align_tokens(student, teacher, 16, patch_only=True)
    assert torch.equal(s, student[:, 1:]) and torch.equal(t, teacher[:, 1:])
    # sequences of different lengths: the last num_patches of each, whatever was asked
    s, t = pairing.align_tokens(student[:, 1:], teacher, 16, patch_only=False)
    assert torch.equal(s, student[:, 1:]) and torch.equal(t, teacher[:, 1:])
    maps = torch.rand(2, 2, 17, 17, dtype=torch.float64)
    s, t = pairing.align_tokens(maps, maps + 1, 16, patch_only=True, is_map=True)
    assert torch.equal(s, maps[..., 1:, 1:]) and torch.equal(t, maps[..., 1:, 1:] + 1)


# ------------------------------------------------------------------ loss weights
@pytest.mark.parametrize('value, positive', [(0, False), (50, False), (0.5, True), (3, True)])
def test_loss_weight_accepted_as_float(value, positive):
    weight = pairing.check_loss_weight(value, positive=positive)
    assert weight == value and type(weight) is float


def test_a_loss_weight_of_zero_is_accepted_unless_asked_otherwise():
    assert pairing.check_loss_weight(0) == 0.


@pytest.mark.parametrize('value, positive, error, message', [
    (0, True, ValueError, r'^w must be a finite number > 0 \(why\), got 0$'),
    (-1.0, False, ValueError, r'^w must be a finite number >= 0 \(why\), got -1.0$'),
    (-1e-9, False, ValueError, 'got -1e-09'),
    (float('nan'), False, ValueError, 'got nan'),
    (float('inf'), True, ValueError, 'got inf'),
    (True, False, TypeError, r"^w must be a number \(why\), got True of type bool$"),
    ('1', True, TypeError, "got '1' of type str"),
    (None, False, TypeError, 'got None of type NoneType'),
], ids=['zero-not-positive', 'negative', 'slightly-negative', 'nan', 'inf', 'bool', 'str',
        'none'])
def test_loss_weight_refused(value, positive, error, message):
    with pytest.raises(error, match=message):
        pairing.check_loss_weight(value, 'w', positive=positive, note=' (why)')
