"""LinearViTCheckpoint: a LinearViT checkpoint loads strictly, operator by operator."""
import copy

import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import LinearViTCheckpointInit, load_linear_vit_checkpoint
from linvit_mm.testing.staged import TINY_ARCH, tiny_vit_cfg, write_recorded_checkpoint


def vit(attn_type='relu', seed=0, **overrides):
    torch.manual_seed(seed)
    return MODELS.build(tiny_vit_cfg(attn_type, **overrides))


def unchanged(model, before):
    return all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_staged_loader_loads_every_tensor(tmp_path):
    source = vit('ttt', seed=1)
    path = write_recorded_checkpoint(tmp_path / 'ttt.pth', source, stage='align-feat')
    target = MODELS.build(tiny_vit_cfg(
        'ttt', init_cfg=dict(type='LinearViTCheckpoint', checkpoint=str(path))))
    target.init_weights()
    assert unchanged(target, source.state_dict())


def test_staged_loader_refuses_other_operator_heads_and_depth_naming_them(tmp_path):
    path = write_recorded_checkpoint(tmp_path / 'relu.pth', vit('relu'))
    cases = [
        (vit('elu'), "operator of blocks 0-2: checkpoint 'relu', model 'elu'"),
        (vit('relu', layer_cfgs=[{}, {}, dict(attn_type='elu')]),
         "operator of blocks 2: checkpoint 'relu', model 'elu'"),
        (vit('relu', arch=dict(TINY_ARCH, num_heads=4)),
         'num_heads of blocks 0-2: checkpoint 2, model 4'),
        (vit('relu', arch=dict(TINY_ARCH, num_layers=4)),
         'num_layers: checkpoint 3, model 4'),
    ]
    for model, message in cases:
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match='nothing was loaded') as info:
            load_linear_vit_checkpoint(model, str(path))
        assert message in str(info.value)
        assert unchanged(model, before)


def test_staged_loader_names_missing_unexpected_and_misshaped_tensors(tmp_path):
    source = vit('relu')
    path = write_recorded_checkpoint(tmp_path / 'relu.pth', source)
    checkpoint = torch.load(path, weights_only=False)
    state = checkpoint['state_dict']
    del state['backbone.layers.1.ffn.layers.1.bias']
    state['backbone.layers.0.attn.extra'] = torch.zeros(1)
    state['backbone.layers.2.ln2.weight'] = torch.ones(7)
    torch.save(checkpoint, path)
    model = vit('relu', seed=3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as info:
        load_linear_vit_checkpoint(model, str(path))
    message = str(info.value)
    assert ('missing keys (the model has them, the checkpoint not): '
            'backbone.layers.1.ffn.layers.1.bias') in message
    assert ('unexpected keys (in the checkpoint, not in the model): '
            'backbone.layers.0.attn.extra') in message
    assert 'backbone.layers.2.ln2.weight: checkpoint (7,), model (32,)' in message
    assert unchanged(model, before)


def test_staged_loader_without_record(tmp_path):
    source = vit('relu')
    path = tmp_path / 'plain.pth'
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in source.state_dict().items()}},
               path)
    model = vit('elu', seed=2)
    with pytest.raises(ValueError, match='does not record the operator of each block'):
        load_linear_vit_checkpoint(model, str(path))
    # on request, names and shapes only: a relu checkpoint then loads into elu
    assert load_linear_vit_checkpoint(model, str(path), require_record=False) is None
    assert unchanged(model, source.state_dict())


def test_staged_loader_prefix_and_type_errors(tmp_path):
    path = write_recorded_checkpoint(tmp_path / 'bare.pth', vit('relu'), prefix='')
    model = vit('relu')
    with pytest.raises(ValueError, match=r"no tensors under 'backbone.'; .* set prefix="):
        load_linear_vit_checkpoint(model, str(path))
    load_linear_vit_checkpoint(model, str(path), prefix='')
    with pytest.raises(TypeError, match='loads into a LinearViT'):
        load_linear_vit_checkpoint(torch.nn.Linear(2, 2), str(path))
    with pytest.raises(FileNotFoundError):
        load_linear_vit_checkpoint(model, str(tmp_path / 'missing.pth'))
    for bad in (dict(checkpoint=None), dict(checkpoint=str(path), prefix=None),
                dict(checkpoint=str(path), require_record='no')):
        with pytest.raises(TypeError):
            LinearViTCheckpointInit(**bad)


def test_staged_loader_resizes_learned_pos_embed_of_another_grid(tmp_path):
    path = write_recorded_checkpoint(tmp_path / 'small_grid.pth', vit('relu'))
    larger = vit('relu', img_size=64)  # 8 x 8 grid instead of 4 x 4
    load_linear_vit_checkpoint(larger, str(path))
    assert larger.pos_embed.shape == (1, 65, 32)


@pytest.mark.parametrize('value', [float('nan'), float('-inf')], ids=['nan', 'inf'])
def test_staged_loader_refuses_non_finite_weights(tmp_path, value):
    source = vit('relu')
    with torch.no_grad():
        source.layers[1].attn.qkv.weight[4, 2] = value
    path = write_recorded_checkpoint(tmp_path / 'diverged.pth', source)
    model = vit('relu', seed=3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r'diverged\.pth: 1 tensor\(s\) hold non-finite') as info:
        load_linear_vit_checkpoint(model, str(path))
    assert 'backbone.layers.1.attn.qkv.weight: 1 ' in str(info.value)
    assert unchanged(model, before)


def test_staged_loader_names_a_truncated_file(tmp_path):
    path = write_recorded_checkpoint(tmp_path / 'stage1.pth', vit('relu'))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match=f'checkpoint {path} cannot be read, it is truncated'):
        load_linear_vit_checkpoint(vit('relu'), str(path))


def test_the_initialiser_requires_a_record_and_a_path_by_default(tmp_path):
    assert LinearViTCheckpointInit('a.pth').require_record is True
    with pytest.raises(TypeError, match="checkpoint must be a file path, got ''"):
        LinearViTCheckpointInit('')


def test_a_block_init_cfg_runs_before_the_load_and_the_load_is_logged(tmp_path, init_info,
                                                                       logged):
    source = vit('relu', seed=1)
    path = write_recorded_checkpoint(tmp_path / 'relu.pth', source, stage='align-attn')
    target = MODELS.build(tiny_vit_cfg(
        'relu', init_cfg=dict(type='LinearViTCheckpoint', checkpoint=str(path)),
        layer_cfgs=dict(init_cfg=dict(type='Constant', val=0, layer='Linear'))))
    with logged() as messages:
        target.init_weights()
    assert unchanged(target, source.state_dict())  # the blocks' constants came first
    assert init_info['layers.0.attn.qkv.weight'] == (
        f"LinearViTCheckpointInit: {path} (prefix 'backbone.')")
    assert (f"LinearViTCheckpoint: loaded {len(source.state_dict())} tensors under 'backbone.' "
            f"from {path} (stage 'align-attn')") in messages
