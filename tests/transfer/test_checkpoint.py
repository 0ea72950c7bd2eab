"""Reading Softmax ViT checkpoints of every known layout into mmpretrain names."""
import argparse
import os
import os.path as osp
import pickle
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import timm
import torch

from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.checkpoint import KNOWN_FORMATS

REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONVERTER = osp.join(REPO_ROOT, 'tools', 'model_converters', 'softmax_vit_to_mmpretrain.py')

# timm block suffix -> mmpretrain TransformerEncoderLayer suffix, written out here
# independently of the module under test.
BLOCK_NAMES = {
    'norm1': 'ln1', 'attn.qkv': 'attn.qkv', 'attn.proj': 'attn.proj', 'norm2': 'ln2',
    'mlp.fc1': 'ffn.layers.0.0', 'mlp.fc2': 'ffn.layers.1'}


def timm_to_mmpretrain(timm_sd):
    out = OrderedDict()
    for key, value in timm_sd.items():
        if key.startswith('blocks.'):
            _, idx, rest = key.split('.', 2)
            module, param = rest.rsplit('.', 1)
            out[f'backbone.layers.{idx}.{BLOCK_NAMES[module]}.{param}'] = value
        elif key.startswith('patch_embed.proj.'):
            out['backbone.patch_embed.projection.' + key.rsplit('.', 1)[1]] = value
        elif key.startswith('norm.'):
            out['backbone.ln1.' + key.rsplit('.', 1)[1]] = value
        elif key.startswith('head.'):
            out['head.layers.head.' + key.rsplit('.', 1)[1]] = value
        else:
            out['backbone.' + key] = value
    return out


def prefixed(prefix, state):
    return OrderedDict((prefix + k, v) for k, v in state.items())


def perturbed(state):
    return OrderedDict((key, value + 1.0) for key, value in state.items())


@pytest.fixture(scope='module')
def expected(timm_sd):
    return timm_to_mmpretrain(timm_sd)


@pytest.fixture(scope='module')
def mmpretrain_modules():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    torch.manual_seed(1)
    backbone = VisionTransformer(arch='deit-tiny', img_size=224, patch_size=16)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    backbone.eval()  # mmpretrain's train() override returns None: no chaining
    head.eval()
    return backbone, head


def _mmpretrain_shapes(backbone, head):
    shapes = {f'backbone.{k}': tuple(v.shape) for k, v in backbone.state_dict().items()}
    shapes.update({f'head.{k}': tuple(v.shape) for k, v in head.state_dict().items()})
    return shapes


def test_own_mapping_matches_mmpretrain_names_and_shapes(timm_sd, expected,
                                                         mmpretrain_modules):
    reference = _mmpretrain_shapes(*mmpretrain_modules)
    assert {k: tuple(v.shape) for k, v in expected.items()} == reference
    mapped = load_softmax_checkpoint({'model': timm_sd}).state_dict
    assert {k: tuple(v.shape) for k, v in mapped.items()} == reference


def test_layer_scale_names_match_mmpretrain():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    torch.manual_seed(0)
    sd = timm.create_model('deit_tiny_patch16_224', pretrained=False,
                           init_values=1e-5).state_dict()
    assert 'blocks.0.ls1.gamma' in sd
    backbone = VisionTransformer(arch='deit-tiny', layer_scale_init_value=1e-5)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    mapped = load_softmax_checkpoint(sd)
    assert mapped.unused_keys == []
    assert ({k: tuple(v.shape) for k, v in mapped.state_dict.items()}
            == _mmpretrain_shapes(backbone, head))


def test_mapped_deit_computes_the_same_logits_in_mmpretrain():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    # A 64-pixel DeiT-Tiny (4x4 grid) keeps the float64 forward cheap; the names and
    # shapes at 224 are checked above.
    torch.manual_seed(3)
    deit = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=64)
    with torch.no_grad():
        for param in deit.parameters():
            param.add_(0.05 * torch.randn_like(param))
    backbone = VisionTransformer(arch='deit-tiny', img_size=64, patch_size=16)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    ckpt = load_softmax_checkpoint({'model': deit.state_dict()})
    assert ckpt.pos_grid == (4, 4)
    backbone.load_state_dict({k[len('backbone.'):]: v for k, v in ckpt.state_dict.items()
                              if k.startswith('backbone.')}, strict=True)
    head.load_state_dict({k[len('head.'):]: v for k, v in ckpt.state_dict.items()
                          if k.startswith('head.')}, strict=True)
    for module in (deit, backbone, head):
        module.double()
        module.eval()
    image = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        reference = deit(image)
        logits = head(backbone(image))
    assert_rel_close(logits, reference, 1e-12, 'logits')


@pytest.fixture(scope='module')
def layouts(timm_sd, expected):
    return _layouts(timm_sd, expected)


def _layouts(sd, mm):
    backbone_only = OrderedDict((k, v) for k, v in sd.items() if not k.startswith('head.'))
    projection_mlp = {'head.0.weight': torch.randn(16, 192), 'head.1.weight': torch.ones(16),
                      'head.1.running_mean': torch.zeros(16)}
    dino_head = {'head.mlp.0.weight': torch.randn(16, 192),
                 'head.last_layer.weight_g': torch.ones(32, 1),
                 'head.last_layer.weight_v': torch.randn(32, 16)}
    decoder = {'mask_token': torch.zeros(1, 1, 16), 'decoder_embed.weight': torch.randn(16, 192),
               'decoder_pos_embed': torch.zeros(1, 197, 16),
               'decoder_blocks.0.attn.qkv.weight': torch.randn(48, 16),
               'decoder_norm.weight': torch.ones(16), 'decoder_pred.weight': torch.randn(768, 16)}
    fc_norm = OrderedDict((k.replace('norm.', 'fc_norm.', 1) if k.startswith('norm.') else k, v)
                          for k, v in sd.items())
    return {
        'deit-official': (
            {'model': sd, 'model_ema': perturbed(sd), 'epoch': 299,
             'args': argparse.Namespace(model='deit_tiny_patch16_224', lr=5e-4)},
            'deit-official', {}, 3),
        'timm-bare': (sd, 'timm', {}, None),
        'timm-train': (
            {'state_dict': prefixed('module.', sd), 'arch': 'deit_tiny_patch16_224',
             'version': 2, 'metric': 72.2},
            'timm', {}, 3),
        'mmpretrain': (
            {'state_dict': OrderedDict(
                mm, **{'data_preprocessor.mean': torch.zeros(3),
                       'neck.weight': torch.ones(3)}),
             'meta': {'cfg': "model = dict(backbone=dict(type='VisionTransformer', "
                             "arch='deit-tiny'))", 'epoch': 300}},
            'mmpretrain', {"mmpretrain 'data_preprocessor'": 1, "mmpretrain 'neck'": 1}, 3),
        'dino-full': (
            {'teacher': OrderedDict(prefixed('backbone.', backbone_only), **dino_head),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'optimizer': {'state': {}, 'param_groups': []}, 'epoch': 100,
             'args': argparse.Namespace(arch='vit_tiny', patch_size=16),
             'dino_loss': {'center': torch.zeros(1, 32)}},
            'dino', {'self-supervised projection head': 3}, 3),
        'dino-ddp-teacher': (
            {'teacher': OrderedDict(prefixed('module.backbone.', backbone_only),
                                    **prefixed('module.', dino_head)),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'dino_loss': {'center': torch.zeros(1, 32)}},
            'dino', {'self-supervised projection head': 3}, None),
        'mocov3': (
            {'epoch': 300, 'arch': 'vit_small',  # MoCo v3's vit_small is 384-d: no heads
             'state_dict': OrderedDict(
                 prefixed('module.base_encoder.', OrderedDict(backbone_only, **projection_mlp)),
                 **prefixed('module.momentum_encoder.', perturbed(backbone_only)),
                 **{'module.predictor.0.weight': torch.randn(16, 16)}),
             'optimizer': {'state': {}, 'param_groups': []}},
            'mocov3', {'MoCo v3 momentum encoder': len(backbone_only),
                       'MoCo v3 predictor MLP': 1,
                       'head that is not a linear classifier (projection MLP)': 3}, None),
        'ibot-release': ({'state_dict': backbone_only}, 'ibot', {}, None),
        'ibot-release-prefixed': (
            {'state_dict': OrderedDict(prefixed('backbone.', backbone_only), **dino_head)},
            'ibot', {'self-supervised projection head': 3}, None),
        'ibot-full': (
            {'teacher': OrderedDict(prefixed('backbone.', backbone_only),
                                    **{'head.last_layer2.weight': torch.randn(8, 4)}),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'ibot_loss': {'center': torch.zeros(1, 8)}},
            'ibot', {'self-supervised projection head': 1}, None),
        'mae-pretrain': (
            {'model': OrderedDict(backbone_only, **decoder), 'epoch': 1599,
             'args': argparse.Namespace(model='mae_vit_base_patch16')},
            'mae', {'MAE decoder': len(decoder)}, None),
        'mae-finetuned': ({'model': fc_norm}, 'mae', {}, None),
    }


LAYOUT_IDS = ['deit-official', 'timm-bare', 'timm-train', 'mmpretrain', 'dino-full',
              'dino-ddp-teacher', 'mocov3', 'ibot-release', 'ibot-release-prefixed',
              'ibot-full', 'mae-pretrain', 'mae-finetuned']
LAYOUTS_WITH_CLASSIFIER = ('deit-official', 'timm-bare', 'timm-train', 'mmpretrain',
                           'mae-finetuned')


@pytest.mark.parametrize('layout', LAYOUT_IDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize('from_file', [True, False], ids=['file', 'in-memory'])
def test_every_layout_maps_to_the_same_tensors(layout, from_file, layouts, expected,
                                                tmp_path):
    raw, source_format, unused_counts, num_heads = layouts[layout]
    if from_file:
        path = tmp_path / f'{layout}.pth'
        torch.save(raw, path)
        ckpt = load_softmax_checkpoint(path)
    else:
        ckpt = load_softmax_checkpoint(raw)

    assert ckpt.source_format == source_format
    assert source_format in KNOWN_FORMATS
    want = OrderedDict(expected)
    if layout == 'mae-finetuned':
        want = OrderedDict((k.replace('backbone.ln1.', 'backbone.ln2.'), v)
                           for k, v in want.items())
    if layout not in LAYOUTS_WITH_CLASSIFIER:
        want = OrderedDict((k, v) for k, v in want.items() if not k.startswith('head.'))
    assert set(ckpt.state_dict) == set(want)
    for key, value in want.items():
        assert torch.equal(ckpt.state_dict[key], value), key
    assert {group: len(keys) for group, keys in ckpt.unused_groups.items()} == unused_counts
    assert sorted(ckpt.unused_keys) == sorted(k for keys in ckpt.unused_groups.values()
                                              for k in keys)
    assert (ckpt.embed_dims, ckpt.depth, ckpt.patch_size) == (192, 12, (16, 16))
    assert (ckpt.pos_grid, ckpt.num_extra_tokens) == ((14, 14), 1)
    assert ckpt.num_heads == num_heads


def test_arch_names_give_heads_only_in_their_own_code_base(timm_sd):
    # timm's train.py names timm models and writes 'version'; the same layout without
    # it (e.g. a MoCo v3 linear-probe checkpoint) may use another code base's names.
    timm_train = {'state_dict': timm_sd, 'arch': 'deit_tiny_patch16_224', 'version': 2}
    assert load_softmax_checkpoint(timm_train).num_heads == 3
    other = {'state_dict': timm_sd, 'arch': 'deit_tiny_patch16_224', 'best_acc1': 70.0}
    assert load_softmax_checkpoint(other).num_heads is None
    dino_name_on_deit = {'model': timm_sd, 'args': argparse.Namespace(model='vit_tiny')}
    assert load_softmax_checkpoint(dino_name_on_deit).num_heads is None
    explicit = {'model': timm_sd, 'args': argparse.Namespace(num_heads=4)}
    assert load_softmax_checkpoint(explicit).num_heads == 4
    impossible = {'model': timm_sd, 'args': argparse.Namespace(num_heads=5)}  # 192 % 5
    ckpt = load_softmax_checkpoint(impossible)
    assert ckpt.num_heads is None and any('does not fit' in note for note in ckpt.notes)


def test_fc_norm_goes_to_the_pooled_norm_or_on_request_the_final_norm(timm_sd):
    raw = {'model': OrderedDict((k.replace('norm.', 'fc_norm.', 1) if k.startswith('norm.')
                                 else k, v) for k, v in timm_sd.items())}
    pooled = load_softmax_checkpoint(raw)
    assert torch.equal(pooled.state_dict['backbone.ln2.weight'], timm_sd['norm.weight'])
    assert 'backbone.ln1.weight' not in pooled.state_dict

    final = load_softmax_checkpoint(raw, fc_norm_target='ln1')
    assert torch.equal(final.state_dict['backbone.ln1.bias'], timm_sd['norm.bias'])
    assert not any(k.startswith('backbone.ln2.') for k in final.state_dict)
    assert any('final norm' in note for note in final.notes)

    mm = load_softmax_checkpoint({'state_dict': pooled.state_dict}, fc_norm_target='ln1')
    assert torch.equal(mm.state_dict['backbone.ln1.weight'], timm_sd['norm.weight'])

    both = OrderedDict(timm_sd, **{'fc_norm.weight': torch.ones(192)})
    with pytest.raises(ValueError, match='both a final norm'):
        load_softmax_checkpoint(both, fc_norm_target='ln1')
    with pytest.raises(ValueError, match="'ln1' or 'ln2'"):
        load_softmax_checkpoint(raw, fc_norm_target='fc_norm')


def test_distilled_deit_drops_the_distillation_slot(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False)
    sd = model.state_dict()
    assert sd['pos_embed'].shape == (1, 198, 192)
    path = tmp_path / 'deit_distilled.pth'
    torch.save({'model': sd}, path)
    ckpt = load_softmax_checkpoint(path)

    pos = ckpt.state_dict['backbone.pos_embed']
    assert pos.shape == (1, 197, 192)
    assert torch.equal(pos[:, :1], sd['pos_embed'][:, :1])
    assert torch.equal(pos[:, 1:], sd['pos_embed'][:, 2:])
    assert (ckpt.num_extra_tokens, ckpt.pos_grid) == (1, (14, 14))
    assert sorted(ckpt.unused_groups['distillation token / head (DeiT distilled)']) == [
        'dist_token', 'head_dist.bias', 'head_dist.weight']
    assert torch.equal(ckpt.state_dict['head.layers.head.weight'], sd['head.weight'])
    assert any('distillation-token slot' in note for note in ckpt.notes)


def test_mmpretrain_distilled_layout_drops_the_slot_too(expected):
    mm = OrderedDict(expected)
    pos = mm['backbone.pos_embed']
    dist_slot = torch.full_like(pos[:, :1], 7.0)
    mm['backbone.pos_embed'] = torch.cat([pos[:, :1], dist_slot, pos[:, 1:]], 1)
    mm['backbone.dist_token'] = torch.zeros(1, 1, 192)
    mm['head.layers.head_dist.weight'] = torch.zeros(1000, 192)
    ckpt = load_softmax_checkpoint({'state_dict': mm})
    assert torch.equal(ckpt.state_dict['backbone.pos_embed'], pos)
    assert len(ckpt.unused_groups['distillation token / head (DeiT distilled)']) == 2


def test_mmpretrain_linear_cls_head_is_the_classifier(expected):
    mm = OrderedDict((k.replace('head.layers.head.', 'head.fc.'), v)
                     for k, v in expected.items())
    ckpt = load_softmax_checkpoint({'state_dict': mm})
    assert torch.equal(ckpt.state_dict['head.layers.head.weight'],
                       expected['head.layers.head.weight'])
    assert ckpt.unused_keys == []


def test_pos_embed_without_class_slot(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['pos_embed'] = timm_sd['pos_embed'][:, 1:]  # DeiT III / timm no_embed_class
    ckpt = load_softmax_checkpoint(sd)
    assert (ckpt.num_extra_tokens, ckpt.pos_grid) == (0, (14, 14))
    assert torch.equal(ckpt.state_dict['backbone.pos_embed'], sd['pos_embed'])
    assert any('no class-token slot' in note for note in ckpt.notes)


def test_non_square_pos_embed_leaves_grid_unknown(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['pos_embed'] = torch.zeros(1, 1 + 14 * 10, 192)
    ckpt = load_softmax_checkpoint(sd)
    assert ckpt.pos_grid is None and ckpt.num_extra_tokens == 1


def test_layer_scale_of_deit3_maps_to_mmpretrain_gamma(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['blocks.0.gamma_1'] = torch.full((192,), 0.1)
    sd['blocks.0.ls2.gamma'] = torch.full((192,), 0.2)
    sd['blocks.0.attn.q_norm.weight'] = torch.ones(64)
    ckpt = load_softmax_checkpoint(sd)
    assert torch.equal(ckpt.state_dict['backbone.layers.0.attn.gamma1.weight'],
                       sd['blocks.0.gamma_1'])
    assert torch.equal(ckpt.state_dict['backbone.layers.0.ffn.gamma2.weight'],
                       sd['blocks.0.ls2.gamma'])
    assert ckpt.unused_groups == {'no counterpart in mmpretrain VisionTransformer':
                                  ['blocks.0.attn.q_norm.weight']}


# ------------------------------------------------------------------------- errors


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


# ---------------------------------------------------------------------- converter


def test_converter_cli_round_trip(timm_sd, expected, tmp_path):
    src = tmp_path / 'deit.pth'
    dst = tmp_path / 'out' / 'deit_mmpretrain.pth'
    torch.save({'model': timm_sd,
                'args': argparse.Namespace(model='deit_tiny_patch16_224')}, src)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    result = subprocess.run([sys.executable, CONVERTER, str(src), str(dst), '--show'],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 'source format   : deit-official' in result.stdout
    assert f'mapped tensors  : {len(expected)}' in result.stdout
    assert 'backbone.layers.11.ffn.layers.1.weight: (192, 768)' in result.stdout

    converted = torch.load(dst, weights_only=True)
    assert converted['meta']['source_format'] == 'deit-official'
    assert converted['meta']['converted_by'] == 'linvit_mm'
    assert list(converted['state_dict']) == list(expected)
    for key, value in expected.items():
        assert torch.equal(converted['state_dict'][key], value), key

    again = load_softmax_checkpoint(dst)
    assert again.source_format == 'mmpretrain'
    assert (again.num_heads, again.pos_grid, again.num_extra_tokens) == (3, (14, 14), 1)
    assert again.unused_keys == []

    failed = subprocess.run([sys.executable, CONVERTER, str(tmp_path / 'missing.pth'),
                             str(dst)], capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1
    assert 'missing.pth' in failed.stderr
