"""transfer_softmax_weights: what each setting copies into every operator, what a misfit
checkpoint (shapes, depth, unreadable, non-finite) is refused for, and the report counts."""
import re
from collections import OrderedDict

import pytest
import timm
import torch

from linvit_mm.models.attention import (LEADING_ROWS, OWN_INIT, WHOLE, attention_class,
                                        attention_types)
from linvit_mm.transfer import COMPONENTS, transfer_softmax_weights

SETTINGS = ('random', 'mimetic', 'impulse', 'copy', 'mlpcopy', 'fullcopy')
C = 192  # DeiT-Tiny width

# Which backbone tensors each copying setting takes (rows of wider layers handled below).
INTENDED = {
    'random': None,
    'mimetic': None,
    'impulse': None,
    'copy': re.compile(r'layers\.\d+\.attn\.(qkv|proj)\.(weight|bias)$'),
    'mlpcopy': re.compile(r'layers\.\d+\.(ffn\.layers\.(0\.0|1)|ln2)\.(weight|bias)$'),
    'fullcopy': re.compile(r'.*'),
}


def expected_copies(attn_type, setting, result, sources):
    """{name: number of leading rows copied, or None for the whole tensor}."""
    pattern = INTENDED[setting]
    if pattern is None:
        return {}
    fill = attention_class(attn_type).softmax_fill
    copies = {}
    for name, value in result.items():
        if not pattern.match(name) or name not in sources:
            continue
        layer = re.match(r'layers\.\d+\.attn\.(qkv|proj)\.', name)
        kind = fill.get(layer.group(1), WHOLE) if layer else WHOLE
        if kind == OWN_INIT:
            continue
        wider = kind == LEADING_ROWS and value.shape != sources[name].shape
        copies[name] = sources[name].shape[0] if wider else None
    return copies


# --------------------------------------------------------------- every setting x operator


@pytest.mark.parametrize('setting', SETTINGS)
@pytest.mark.parametrize('attn_type', attention_types())
def test_setting_copies_exactly_the_intended_tensors(attn_type, setting, ckpt_paths, sources,
                                                     random_state, build, state,
                                                     assert_same_state):
    reference = random_state(attn_type)
    model = build(attn_type)
    operator = attention_class(attn_type)
    if setting in ('mimetic', 'impulse') and not operator.has_qk_form:
        with pytest.raises(ValueError, match=rf"not defined for the '{attn_type}'.*QK\^T"):
            transfer_softmax_weights(model, None, setting=setting)
        assert_same_state(state(model), reference)
        return

    checkpoint = None if setting in ('random', 'mimetic', 'impulse') else ckpt_paths['timm']
    report = transfer_softmax_weights(model, checkpoint, setting=setting)
    result = state(model)
    copies = expected_copies(attn_type, setting, result, sources)
    analytic = set()
    if setting in ('mimetic', 'impulse'):
        analytic = {f'layers.{i}.attn.{layer}.weight' for i in range(12)
                    for layer in ('qkv', 'proj')}
        if setting == 'impulse' and model.pos_embed is not None:
            analytic.add('pos_embed')

    assert list(result) == list(reference)
    for name, value in result.items():
        if name in copies:
            rows = copies[name]
            if rows is None:
                assert torch.equal(value, sources[name]), name
            else:
                assert torch.equal(value[:rows], sources[name]), name
                assert torch.equal(value[rows:], reference[name][rows:]), name
        elif name == 'pos_embed' and setting == 'impulse':
            # the learned embedding is scaled so it dominates the patch embedding
            assert torch.equal(value, reference[name] * 18.), name
        elif name in analytic:
            assert not torch.equal(value, reference[name]), name
        else:
            assert torch.equal(value, reference[name]), name
    assert set(report['copied']) == set(copies)
    assert set(report['analytic']) == analytic
    if setting in ('copy', 'fullcopy'):
        assert set(report['partial']) == {n for n, rows in copies.items() if rows}
        for layer, fill in operator.softmax_fill.items():
            if fill == OWN_INIT:
                reason = report['kept own init'][f'layers.0.attn.{layer}.weight']
                assert 'operator-specific' in reason


def test_ttt_takes_the_leading_qkv_rows_only(ckpt_paths, sources, build):
    model = build('ttt')
    report = transfer_softmax_weights(model, ckpt_paths['timm'], setting='copy')
    assert model.layers[0].attn.qkv.weight.shape[0] > 3 * C
    assert torch.equal(model.layers[0].attn.qkv.weight[:3 * C],
                       sources['layers.0.attn.qkv.weight'])
    assert report['partial']['layers.0.attn.qkv.weight'].startswith(f'rows 0:{3 * C} of ')


@pytest.mark.parametrize('layout', ['deit-official', 'timm', 'mmpretrain'])
def test_fullcopy_reads_every_layout_alike(layout, ckpt_paths, sources, build, state,
                                           assert_same_state):
    model = build('softmax')
    report = transfer_softmax_weights(model, ckpt_paths[layout], setting='fullcopy')
    assert report['source_format'] == layout
    assert_same_state(state(model), OrderedDict((k, sources[k]) for k in model.state_dict()))


def test_component_form_ablates_one_component(ckpt_paths, sources, random_state, build, state,
                                              assert_same_state):
    without_cls = [name for name in COMPONENTS if name != 'cls_token']
    model = build('softmax')
    report = transfer_softmax_weights(model, ckpt_paths['timm'], components=without_cls)
    assert report['setting'] is None and report['components'] == without_cls
    assert report['kept own init'] == {'cls_token': 'not selected'}
    result = state(model)
    assert torch.equal(result['cls_token'], random_state('softmax')['cls_token'])
    for name, value in result.items():
        if name != 'cls_token':
            assert torch.equal(value, sources[name]), name

    every = build('softmax')
    transfer_softmax_weights(every, ckpt_paths['timm'], components=list(COMPONENTS))
    full = build('softmax')
    transfer_softmax_weights(full, ckpt_paths['timm'], setting='fullcopy')
    assert_same_state(state(every), state(full))


def test_pos_embed_is_resized_to_the_model_grid(ckpt_paths, timm_sd, build):
    from mmpretrain.models.utils import resize_pos_embed
    model = build('relu', img_size=112)
    report = transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcopy')
    expected = resize_pos_embed(timm_sd['pos_embed'], (14, 14), (7, 7), 'bicubic', 1)
    assert model.pos_embed.shape == (1, 50, C)
    assert torch.equal(model.pos_embed.detach(), expected)
    assert 'pos_embed' in report['copied']
    assert any('resized from 14x14 to 7x7' in note for note in report['notes'])


def test_a_bare_conv_patch_embedding_is_copied(timm_sd, sources, build):
    sd = OrderedDict((k.replace('patch_embed.proj.', 'patch_embed.'), v)
                     for k, v in timm_sd.items())
    model = build('softmax')
    report = transfer_softmax_weights(model, sd, setting='fullcopy')
    assert report['counts']['patch_embed']['copied'] == 2
    assert torch.equal(model.patch_embed.projection.weight,
                       sources['patch_embed.projection.weight'])


# --------------------------------------------------------------- shape errors


@pytest.mark.parametrize('setting,first', [
    ('fullcopy', 'backbone.cls_token: checkpoint (1, 1, 768) vs model (1, 1, 192)'),
    ('mlpcopy', 'backbone.layers.0.ln2.weight: checkpoint (768,) vs model (192,)'),
], ids=['fullcopy', 'mlpcopy'])
def test_deit_base_into_tiny_names_the_mismatch_and_copies_nothing(setting, first, build,
                                                                   refuses):
    torch.manual_seed(0)
    base_sd = timm.create_model('deit_base_patch16_224', pretrained=False).state_dict()
    message = refuses(build('relu'), {'model': base_sd}, setting=setting)
    assert first in message.splitlines()[2]
    assert 'embed_dims=768' in message and 'Nothing was copied' in message


def test_one_misfit_tensor_stops_every_copy(timm_sd, build, refuses):
    sd = OrderedDict(timm_sd)
    sd['blocks.11.mlp.fc1.weight'] = sd['blocks.11.mlp.fc1.weight'][:700]
    refuses(build('elu'), sd, setting='fullcopy', match=re.escape(
        'backbone.layers.11.ffn.layers.0.0.weight: checkpoint (700, 192) vs model (768, 192)'))


def test_depth_mismatch_names_the_missing_blocks(timm_sd, build, refuses):
    shallow = OrderedDict((k, v) for k, v in timm_sd.items()
                          if not re.match(r'blocks\.([6-9]|1[01])\.', k))
    refuses(build('inline'), shallow, setting='mlpcopy',
            match=r'depth differs: the model has 12 blocks, the checkpoint 6; blocks 6-11 of '
                  r'the model are not in the checkpoint')


def test_unreadable_or_missing_checkpoints(tmp_path, build):
    model = build('softmax')
    wrong_layout = tmp_path / 'optimizer.pth'
    torch.save({'optimizer': {'lr': torch.tensor(0.1)}, 'epoch': 3}, wrong_layout)
    with pytest.raises(ValueError, match='unrecognised checkpoint layout.*Known formats'):
        transfer_softmax_weights(model, wrong_layout, setting='copy')
    truncated = tmp_path / 'interrupted_download.pth'
    torch.save({'model': {'pos_embed': torch.zeros(1, 197, C)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(ValueError, match='is not a PyTorch checkpoint'):
        transfer_softmax_weights(model, truncated, setting='copy')
    with pytest.raises(FileNotFoundError, match='missing.pth'):
        transfer_softmax_weights(model, tmp_path / 'missing.pth', setting='copy')
    with pytest.raises(ValueError, match='checkpoint is None'):
        transfer_softmax_weights(model, None, setting='fullcopy')


def test_non_finite_checkpoint_copies_nothing(timm_sd, build, refuses):
    sd = OrderedDict(timm_sd, **{'blocks.0.norm2.weight': torch.full((C, ), float('nan'))})
    refuses(build('relu'), sd, setting='mlpcopy',
            match=r'backbone\.layers\.0\.ln2\.weight \(blocks\.0\.norm2\.weight\): 192 NaN of 192')


def test_bad_options_list_the_valid_ones(ckpt_paths, build):
    model = build('softmax')
    with pytest.raises(ValueError, match='random, mimetic, impulse, copy, mlpcopy, fullcopy'):
        transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcpy')
    with pytest.raises(ValueError, match='valid options are'):
        transfer_softmax_weights(model, setting='mimetic', analytic_cfg=dict(alpha=1.))


# --------------------------------------------------------------- report


@pytest.mark.parametrize('attn_type,counts', [
    ('mhla', {'attention': (48, 36, 0), 'pos_embed': (0, 0, 1), 'cls_token': (0, 0, 1)}),
    ('ttt', {'attention': (24, 84, 0), 'pos_embed': (0, 0, 1), 'cls_token': (0, 0, 1)}),
    ('softmax', {'attention': (48, 0, 0), 'pos_embed': (1, 0, 0), 'cls_token': (1, 0, 0)}),
], ids=['mhla', 'ttt', 'softmax'])
def test_report_counts(attn_type, counts, ckpt_paths, build):
    model = build(attn_type)
    report = transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcopy')
    for component, (copied, kept, not_in_model) in counts.items():
        row = report['counts'][component]
        assert (row['copied'], row['kept own init'], row['not in model']) == (
            copied, kept, not_in_model), component
    assert report['counts']['mlp']['copied'] == 72  # fc1, fc2, ln2 of 12 blocks
    assert report['counts']['norms']['copied'] == 26  # ln1 of 12 blocks, final norm
    module_states = ('copied', 'analytic', 'kept own init', 'absent in checkpoint')
    assert sum(row[key] for row in report['counts'].values()
               for key in module_states) == len(model.state_dict())
    assert len(report['copied']) == sum(row['copied'] for row in report['counts'].values())
    if attn_type == 'mhla':
        assert report['not in model'] == ['cls_token', 'pos_embed']
        assert report['kept own init']['layers.3.attn.block_mixing'] == 'operator-specific'


# --------------------------------------------------------------- a hybrid


HYBRID = ['softmax', 'relu', 'relu', 'hedgehog', 'relu', 'ttt', 'elu', 'relu', 'inline',
          'mhla', 'relu', 'softmax']


def test_fullcopy_fills_each_block_of_a_hybrid_by_its_operator(ckpt_paths, sources, build,
                                                              state):
    """Every block is filled as the single-operator model of its operator fills that block
    (whole, leading rows, or its own init), and nothing else of the block changes."""
    hybrid = build(HYBRID, with_cls_token=True)
    before = state(hybrid)
    report = transfer_softmax_weights(hybrid, ckpt_paths['timm'], setting='fullcopy')
    after = state(hybrid)
    for name in set(HYBRID):
        single = build(name, with_cls_token=True)
        expected = transfer_softmax_weights(single, ckpt_paths['timm'], setting='fullcopy')
        for index in [i for i, block in enumerate(HYBRID) if block == name]:
            tensors = [key for key in after if key.startswith(f'layers.{index}.')]
            assert tensors == [key for key in state(single) if key.startswith(f'layers.{index}.')]
            for key in tensors:
                copied = key in expected['copied']
                assert (key in report['copied']) == copied, key
                assert report['partial'].get(key) == expected['partial'].get(key), key
                if not copied:
                    assert torch.equal(after[key], before[key]), key
                    continue
                rows = sources[key].shape[0]
                assert torch.equal(after[key][:rows], sources[key]), key
                assert torch.equal(after[key][rows:], before[key][rows:]), key
    assert report['partial']['layers.5.attn.qkv.weight'].startswith(f'rows 0:{3 * C} of ')
    assert 'layers.3.attn.feature_proj' in report['kept own init']


# --------------------------------------------------------------- options and misfits


def test_a_setting_that_copies_nothing_does_not_read_the_checkpoint(tmp_path, build, state,
                                                                    random_state,
                                                                    assert_same_state):
    model = build('relu')
    report = transfer_softmax_weights(model, tmp_path / 'never_read.pth', setting='random')
    assert report['notes'] == ["setting 'random' copies nothing; the checkpoint was not read"]
    assert report['source_format'] is None and report['copied'] == []
    assert_same_state(state(model), random_state('relu'))


def test_analytic_options_are_refused_by_a_copying_setting(ckpt_paths, build, refuses):
    refuses(build('relu'), ckpt_paths['timm'], setting='copy', analytic_cfg=dict(qk_alpha=1.),
            match=re.escape("analytic_cfg {'qk_alpha': 1.0} is only used by the mimetic and "
                            'impulse settings'))


@pytest.mark.parametrize('change', ['narrower', 'more rows'])
def test_a_misfit_tensor_an_operator_fills_by_rows_is_refused(change, timm_sd, build, refuses):
    """TTT takes a checkpoint's qkv as the leading rows of its wider one: only a tensor with
    fewer rows and the same columns fits that way."""
    model = build('ttt')
    rows = model.layers[3].attn.qkv.weight.shape[0]
    qkv = timm_sd['blocks.3.attn.qkv.weight']
    misfit = qkv[:, :100] if change == 'narrower' else torch.zeros(rows + 1, C)
    sd = OrderedDict(timm_sd, **{'blocks.3.attn.qkv.weight': misfit})
    message = refuses(model, sd, setting='copy')
    assert message.splitlines()[1:3] == [
        '  1 tensor(s) differ in shape, the first:',
        f'    backbone.layers.3.attn.qkv.weight: checkpoint {tuple(misfit.shape)} vs model '
        f'({rows}, {C})']


@pytest.mark.parametrize('model_depth,ckpt_blocks,problem', [
    (6, range(12), 'the model has 6 blocks, the checkpoint 12; checkpoint blocks 6-11 have no '
                   'place in the model'),
    (12, [0, 1] + list(range(3, 12)), 'the model has 12 blocks, the checkpoint 11; blocks 2 of '
                                      'the model are not in the checkpoint'),
    (6, [0, 1] + list(range(3, 12)), 'the model has 6 blocks, the checkpoint 11; blocks 2 of the '
                                     'model are not in the checkpoint; checkpoint blocks 6-11 '
                                     'have no place in the model'),
], ids=['deeper-checkpoint', 'a-block-missing', 'both'])
def test_a_depth_mismatch_names_both_sides(model_depth, ckpt_blocks, problem, timm_sd, build,
                                           refuses):
    keep = {f'blocks.{i}.' for i in ckpt_blocks}
    sd = OrderedDict((k, v) for k, v in timm_sd.items()
                     if not k.startswith('blocks.') or k[:k.index('.', 7) + 1] in keep)
    model = build('relu', arch=dict(embed_dims=C, num_layers=model_depth, num_heads=3,
                                    feedforward_channels=4 * C))
    message = refuses(model, sd, setting='mlpcopy')
    assert message.splitlines()[1] == f'  depth differs: {problem}'


def test_tensors_of_no_component_are_reported_as_other(ckpt_paths, sources, state):
    """A whole classifier with a neck: the neck has no Softmax ViT counterpart."""
    from mmpretrain.models import ImageClassifier
    torch.manual_seed(0)
    classifier = ImageClassifier(
        backbone=dict(type='LinearViT', arch='tiny', attn_type='relu'),
        neck=dict(type='LinearNeck', in_channels=C, out_channels=C, gap_dim=0),
        head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=C))
    neck = {f'neck.{name}': value for name, value in state(classifier.neck).items()}
    report = transfer_softmax_weights(classifier, ckpt_paths['timm'], setting='fullcopy',
                                      prefix='')
    assert report['counts']['other'] == {'copied': 0, 'analytic': 0,
                                         'kept own init': len(neck), 'absent in checkpoint': 0,
                                         'not in model': 0}
    assert {name: report['kept own init'][name] for name in neck} == dict.fromkeys(
        neck, 'no Softmax ViT counterpart')
    after = state(classifier)
    for name, value in neck.items():
        assert torch.equal(after[name], value), name
    assert torch.equal(after['backbone.layers.0.attn.qkv.weight'],
                       sources['layers.0.attn.qkv.weight'])


@pytest.mark.parametrize('attn_type,noted', [('mhla', True), ('softmax', False)],
                         ids=['sincos-pos', 'learned-pos'])
def test_impulse_notes_a_fixed_position_embedding_it_cannot_rescale(attn_type, noted, build):
    model = build(attn_type)
    notes = transfer_softmax_weights(model, setting='impulse')['notes']
    note = ('impulse: the model has no learned pos_embed; query/key were solved against its '
            f'fixed sin-cos embedding of the {tuple(model.patch_resolution)} grid, which is not '
            'rescaled')
    assert (note in notes) == noted
    assert not any(n.startswith('impulse:') and n != note for n in notes)


def test_many_misfit_tensors_are_counted_and_five_named(timm_sd, build):
    sd = OrderedDict(timm_sd)
    for i in range(7):
        sd[f'blocks.{i}.mlp.fc1.bias'] = torch.zeros(700)
    with pytest.raises(ValueError) as info:
        transfer_softmax_weights(build('elu'), sd, setting='fullcopy')
    message = str(info.value)
    assert '  7 tensor(s) differ in shape, the first:\n' in message
    named = re.findall(r'^    backbone\.layers\.(\d)\.ffn\.layers\.0\.0\.bias: ', message, re.M)
    assert named == ['0', '1', '2', '3', '4']


def test_a_checkpoint_object_with_non_float_tensors_is_refused(timm_sd, build, refuses):
    """A ``SoftmaxCheckpoint`` built in memory is not read through the file checks."""
    from linvit_mm.transfer import SoftmaxCheckpoint, load_softmax_checkpoint
    ckpt = load_softmax_checkpoint(timm_sd)
    state = OrderedDict(ckpt.state_dict)
    for i in range(6):
        state[f'backbone.layers.{i}.ffn.layers.1.bias'] = torch.zeros(192, dtype=torch.int32)
    integer = SoftmaxCheckpoint(**dict(vars(ckpt), state_dict=state))
    refuses(build('elu'), integer, setting='mlpcopy', match=(
        r'holds 6 selected tensor\(s\) that are not floating point.*:\n  '
        r'backbone\.layers\.0\.ffn\.layers\.1\.bias: torch\.int32\n(  backbone.*\n){4}  \.\.\.\n'
        r'Nothing was copied'))
