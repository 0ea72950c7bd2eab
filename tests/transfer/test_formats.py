"""Reading checkpoint files and finding the Softmax encoder inside them: what is refused."""
import argparse
import pickle
import re
from collections import OrderedDict

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer

from linvit_mm.models import LinearViT
from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.formats import KNOWN_FORMATS


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / 'nowhere' / 'deit.pth'
    with pytest.raises(FileNotFoundError, match='nowhere'):
        load_softmax_checkpoint(path)


@pytest.mark.parametrize('content', [
    {'conv1.weight': torch.zeros(1), 'fc.weight': torch.zeros(1)},
    {'state_dict': {'backbone.stages.0.conv.weight': torch.zeros(1)}},
    {'epoch': 3, 'optimizer': {}},
], ids=['resnet-like', 'mmpretrain-non-vit', 'no-weights'])
def test_unrecognised_layout_lists_keys_and_formats(content, tmp_path):
    path = tmp_path / 'other.pth'
    torch.save(content, path)
    with pytest.raises(ValueError, match='unrecognised checkpoint layout') as info:
        load_softmax_checkpoint(path)
    message = str(info.value)
    assert list(content)[0] in message
    assert all(name in message for name in KNOWN_FORMATS)


def test_non_checkpoint_files_are_rejected(tmp_path):
    text = tmp_path / 'notes.txt'
    text.write_text('not a checkpoint\n')
    empty = tmp_path / 'empty.pth'
    empty.write_bytes(b'')
    for path in (text, empty):
        with pytest.raises(ValueError, match='is not a PyTorch checkpoint'):
            load_softmax_checkpoint(path)
    tensor_file = tmp_path / 'tensor.pth'
    torch.save(torch.zeros(3), tensor_file)
    with pytest.raises(ValueError, match='dict-like'):
        load_softmax_checkpoint(tensor_file)
    with pytest.raises(TypeError, match='checkpoint path or a loaded'):
        load_softmax_checkpoint(42)


class _WritesAFile:
    """Unpickling this object runs code that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f'open({self.marker!r}, "w").close()',)


def test_malicious_pickle_is_refused_and_never_runs(timm_sd, tmp_path):
    proof = tmp_path / 'proof'
    pickle.loads(pickle.dumps(_WritesAFile(proof)))
    assert proof.exists(), 'the payload must really run when unpickled unsafely'

    marker = tmp_path / 'pwned'
    path = tmp_path / 'evil.pth'
    torch.save({'model': timm_sd, 'args': _WritesAFile(marker)}, path)
    with pytest.raises(ValueError, match=r"refused to load.*'(builtins\.)?exec'"):
        load_softmax_checkpoint(path)
    assert not marker.exists()


def test_numpy_metadata_and_namespace_args_load(timm_sd, tmp_path):
    path = tmp_path / 'with_numpy.pth'
    torch.save({'model': timm_sd, 'best_acc': np.float64(72.2), 'seed': np.arange(2),
                'args': argparse.Namespace(model='deit_tiny_patch16_224')}, path)
    assert load_softmax_checkpoint(path).source_format == 'deit-official'


def test_run_checkpoint_with_message_hub_is_read(tmp_path):
    # A Softmax model trained by this project's own tools (an mmengine run checkpoint) can
    # seed the transfer: the demo pre-trains its teacher with tools/train.py.
    vit = LinearViT(arch=dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64),
                    attn_type='softmax', img_size=32)
    state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state['head.layers.head.weight'] = torch.zeros(6, 32)
    state['head.layers.head.bias'] = torch.zeros(6)
    buffer = HistoryBuffer()
    buffer.update(np.float64(1.0))
    path = tmp_path / 'iter_600.pth'
    torch.save({'meta': {'iter': 600, 'seed': np.int64(0)}, 'state_dict': state,
                'message_hub': {'log_scalars': {'train/loss': buffer}},
                'optimizer': {'state': {}, 'param_groups': []}}, path)
    ckpt = load_softmax_checkpoint(str(path))
    assert ckpt.source_format == 'mmpretrain'
    assert ckpt.embed_dims == 32 and ckpt.depth == 2
    assert torch.equal(ckpt.state_dict['backbone.layers.1.attn.qkv.weight'],
                       vit.layers[1].attn.qkv.weight)



def test_non_tensor_entries_of_the_state_dict_are_set_aside(timm_sd, expected):
    with_version = OrderedDict(timm_sd, version=2, _arch='deit_tiny')
    ckpt = load_softmax_checkpoint({'model': with_version})
    assert ckpt.unused_groups['non-tensor entries'] == ['version', '_arch']
    assert set(ckpt.state_dict) == set(expected)
    assert 'non-tensor entries' not in load_softmax_checkpoint(timm_sd).unused_groups


@pytest.mark.parametrize('extra,layout,method', [
    ({}, 'dino', 'DINO'), ({'ibot_loss': {'center': torch.zeros(8)}}, 'ibot', 'iBOT'),
], ids=['dino', 'ibot'])
def test_a_teacher_in_timm_names_is_the_encoder(extra, layout, method, timm_sd, expected):
    """A DINO / iBOT checkpoint whose teacher is a bare timm ViT (no ``backbone.`` wrapper)."""
    student = OrderedDict((k, torch.zeros_like(v)) for k, v in timm_sd.items())
    ckpt = load_softmax_checkpoint(dict({'teacher': timm_sd, 'student': student, 'epoch': 3},
                                        **extra))
    assert ckpt.source_format == layout
    assert f'{method}: using the teacher; the student is ignored' in ckpt.notes
    assert list(ckpt.state_dict) == list(expected)
    for name, value in expected.items():
        assert torch.equal(ckpt.state_dict[name], value), name


# ------------------------------------------------------------------ non-finite tensors


def test_nan_and_inf_are_refused_naming_the_tensors(timm_sd, tmp_path):
    sd = OrderedDict(timm_sd)
    sd['blocks.3.mlp.fc1.weight'] = sd['blocks.3.mlp.fc1.weight'].clone()
    sd['blocks.3.mlp.fc1.weight'][0, :2] = float('nan')
    sd['blocks.5.attn.qkv.bias'] = sd['blocks.5.attn.qkv.bias'].clone()
    sd['blocks.5.attn.qkv.bias'][7] = float('inf')
    path = tmp_path / 'diverged.pth'
    torch.save({'model': sd}, path)
    with pytest.raises(ValueError) as info:
        load_softmax_checkpoint(path)
    message = str(info.value)
    assert '2 tensor(s) hold non-finite values' in message
    assert ('backbone.layers.3.ffn.layers.0.0.weight (blocks.3.mlp.fc1.weight): 2 NaN of '
            '147456') in message
    assert 'backbone.layers.5.attn.qkv.bias (blocks.5.attn.qkv.bias): 1 Inf of 576' in message
    assert str(path) in message


def test_many_non_finite_tensors_are_counted_and_the_first_named(timm_sd):
    sd = OrderedDict((k, torch.full_like(v, float('nan')) if k.startswith('blocks.') else v)
                     for k, v in timm_sd.items())
    with pytest.raises(ValueError) as info:
        load_softmax_checkpoint(sd)
    message = str(info.value)
    assert message.startswith('the given checkpoint: 144 tensor(s) hold non-finite values')
    assert len(re.findall(r'^  backbone\.layers\.0\.', message, re.M)) == 5
    assert '... and 139 more' in message


def test_non_finite_values_outside_the_encoder_are_not_read(timm_sd):
    # The MAE decoder is never copied: a NaN there does not stop the encoder's transfer.
    raw = {'model': OrderedDict(timm_sd, **{
        'decoder_embed.weight': torch.full((16, 192), float('nan')),
        'mask_token': torch.zeros(1, 1, 16)})}
    ckpt = load_softmax_checkpoint(raw)
    assert ckpt.source_format == 'mae'
    assert 'MAE decoder' in ckpt.unused_groups


# ---------------------------------------------------------- what the reading says it did


@pytest.mark.parametrize('refuse,value', [('refuse_non_float', torch.zeros(2, dtype=torch.int8)),
                                          ('refuse_non_finite', torch.full((2,), float('nan')))])
@pytest.mark.parametrize('count', [5, 6])
def test_five_bad_tensors_are_named_and_the_rest_counted(refuse, value, count):
    from linvit_mm.transfer import formats
    state = OrderedDict((f'backbone.t{i}', value) for i in range(count))
    origins = {'backbone.t0': 't0'}
    with pytest.raises(ValueError) as info:
        getattr(formats, refuse)(state, origins, 'here')
    message = str(info.value)
    assert message.count('\n  backbone.t') == 5
    assert '\n  backbone.t0 (t0): ' in message and '\n  backbone.t1: ' in message
    assert ('... and 1 more' in message) == (count == 6)
    assert '... and 0 more' not in message


def test_the_entries_beside_the_weights_are_noted(timm_sd):
    ckpt = load_softmax_checkpoint({
        'model': timm_sd, 'ema': {'w': torch.zeros(1)},
        'model_ema': {'w': torch.zeros(1), 'b': torch.zeros(1)}, 'epoch': 3})
    assert ("read the 'model' entry; ignored top-level entries: ema (1 tensor), "
            'model_ema (2 tensors), epoch') in ckpt.notes
    assert not any('ignored top-level entries' in note
                   for note in load_softmax_checkpoint({'model': timm_sd}).notes)


def test_an_unrecognised_layout_shows_eight_entries_and_six_tensor_keys():
    entries = {f'entry{i}': i for i in range(10)}
    with pytest.raises(ValueError, match=re.escape(f'Top-level keys: {list(entries)[:8]};')):
        load_softmax_checkpoint(entries)
    tensors = OrderedDict((f'conv{i}.weight', torch.zeros(1)) for i in range(7))
    with pytest.raises(ValueError, match=re.escape(f'example tensor keys: {list(tensors)[:6]}.')):
        load_softmax_checkpoint({'state_dict': tensors})


def test_an_mmpretrain_state_without_patch_embedding_is_still_mmpretrains(expected):
    state = OrderedDict((k, v) for k, v in expected.items()
                        if not k.startswith('backbone.patch_embed.'))
    assert load_softmax_checkpoint({'state_dict': state}).source_format == 'mmpretrain'


def test_timm_eva_layers_are_folded_and_noted(timm_source):
    ckpt = load_softmax_checkpoint(timm_source('eva02-tiny', img_size=56).state_dict())
    assert ckpt.ffn_type == 'swiglu'
    assert ('EVA attention: the query and value biases (the key\'s fixed at zero) are read as '
            'one qkv bias with zero key rows') in ckpt.notes


def test_mocov3_reads_the_base_encoder_and_groups_the_rest(timm_sd):
    state = OrderedDict(('module.base_encoder.' + k, v) for k, v in timm_sd.items())
    state['module.momentum_encoder.cls_token'] = torch.zeros(1, 1, 192)
    state['module.predictor.0.weight'] = torch.zeros(4, 4)
    ckpt = load_softmax_checkpoint({'state_dict': state})
    assert ckpt.source_format == 'mocov3'
    assert ('MoCo v3: using base_encoder (momentum_encoder and predictor ignored; '
            'base_encoder.head is the projection MLP)') in ckpt.notes
    assert ckpt.unused_groups['MoCo v3 momentum encoder'] == ['momentum_encoder.cls_token']
    assert ckpt.unused_groups['MoCo v3 predictor MLP'] == ['predictor.0.weight']


@pytest.mark.parametrize('container,extra,layout,note', [
    ('teacher', {}, 'dino',
     'DINO: using the teacher (the network DINO evaluates); the student is ignored'),
    ('teacher', {'ibot_loss': {}}, 'ibot',
     'iBOT: using the teacher (the network iBOT evaluates); the student is ignored'),
    ('state_dict', {}, 'ibot', None),
], ids=['dino-teacher', 'ibot-teacher', 'ibot-backbone-file'])
def test_a_backbone_prefixed_encoder_is_dino_or_ibot(container, extra, layout, note, timm_sd):
    encoder = OrderedDict(('backbone.' + k, v) for k, v in timm_sd.items())
    encoder['head.mlp.0.weight'] = torch.zeros(4, 4)
    ckpt = load_softmax_checkpoint(dict({container: encoder}, **extra))
    assert ckpt.source_format == layout
    assert ckpt.unused_groups['self-supervised projection head'] == ['head.mlp.0.weight']
    assert [n for n in ckpt.notes if 'using the teacher' in n] == ([note] if note else [])


@pytest.mark.parametrize('extra', [{'decoder_embed.weight': torch.zeros(4, 4)},
                                   {'mask_token': torch.zeros(1, 1, 4)}],
                         ids=['decoder-only', 'mask-token-only'])
def test_either_pre_training_part_makes_an_mae_checkpoint(extra, timm_sd):
    assert load_softmax_checkpoint(
        {'model': OrderedDict(timm_sd, **extra)}).source_format == 'mae'


@pytest.mark.parametrize('key', ['masked_embed', 'head.last_layer2.weight', 'head.mlp2.0.weight'])
def test_each_sign_of_an_ibot_student_makes_an_ibot_teacher(key, timm_sd):
    student = OrderedDict(timm_sd, **{key: torch.zeros(4)})
    ckpt = load_softmax_checkpoint({'teacher': timm_sd, 'student': student})
    assert ckpt.source_format == 'dino'  # the teacher alone shows no sign
    ckpt = load_softmax_checkpoint({'teacher': OrderedDict(timm_sd, **{key: torch.zeros(4)}),
                                    'student': student})
    assert ckpt.source_format == 'ibot'


@pytest.mark.parametrize('container,beside,layout', [
    ('model', {}, 'deit-official'),
    ('state_dict', {}, 'ibot'),  # iBOT's released backbone files hold nothing else
    ('state_dict', {'arch': 'deit_tiny_patch16_224', 'version': 2}, 'timm'),  # timm train.py
    ('state_dict', {'ibot_loss': {}}, 'ibot'),
    (None, {}, 'timm'),
], ids=['model', 'state-dict-alone', 'state-dict-of-timm-train', 'state-dict-with-ibot-loss',
        'bare'])
def test_the_container_of_a_timm_named_encoder_tells_its_layout(container, beside, layout,
                                                                timm_sd):
    raw = dict(timm_sd) if container is None else dict({container: timm_sd}, **beside)
    assert load_softmax_checkpoint(raw).source_format == layout


@pytest.mark.parametrize('container,layout', [('model', 'mae'), ('state_dict', 'ibot')])
def test_a_pooled_norm_makes_a_model_entry_a_fine_tuned_mae(container, layout,
                                                            timm_sd_fc_norm):
    assert load_softmax_checkpoint({container: timm_sd_fc_norm}).source_format == layout


def test_a_release_is_read_with_its_groups_and_notes(timm_source, release):
    from linvit_mm.transfer.releases import PRETRAINING_GROUP
    state = release('dinov2-reg-small', timm_source('dinov2-reg-small', img_size=56).state_dict())
    ckpt = load_softmax_checkpoint(state)
    assert ckpt.source_format == 'dinov2'
    assert ckpt.unused_groups[PRETRAINING_GROUP] == ['mask_token']
    assert any(note.startswith('DINOv2 with registers: ') for note in ckpt.notes)
