"""Checkpoints of linear-attention ViTs are refused by the Softmax transfer, naming the family:
ViT³, InLine, MHLA, LoLCATs / Hedgehog maps and LinearViT checkpoints of a linear operator,
built here in the released layouts (keys and shapes as the official code names them,
random weights, small sizes). Softmax checkpoints that look alike are not."""
from collections import OrderedDict

import pytest
import torch

from linvit_mm.engine.hooks import AttentionDistillHook
from linvit_mm.models import LinearViT
from linvit_mm.staged import RECORD_KEY, describe_linear_vit
from linvit_mm.transfer import transfer_softmax_weights
from linvit_mm.transfer.linear_sources import LINEAR_SOURCES, detect_linear_source

C, HEADS, DEPTH, PATCH, GRID = 32, 2, 2, 8, 2
D = C // HEADS
ARCH = dict(embed_dims=C, num_layers=DEPTH, num_heads=HEADS, feedforward_channels=2 * C)


def rand(*shape):
    return torch.randn(*shape)


def softmax_vit_state(cls_token=True, pos_embed=True, qkv_rows=3 * C, proj_in=C):
    """A DeiT-style state dict in timm names."""
    state = OrderedDict([('patch_embed.proj.weight', rand(C, 3, PATCH, PATCH)),
                         ('patch_embed.proj.bias', rand(C))])
    if cls_token:
        state['cls_token'] = rand(1, 1, C)
    if pos_embed:
        state['pos_embed'] = rand(1, int(cls_token) + GRID * GRID, C)
    for i in range(DEPTH):
        block = f'blocks.{i}.'
        state.update([(block + 'norm1.weight', rand(C)), (block + 'norm1.bias', rand(C)),
                      (block + 'attn.qkv.weight', rand(qkv_rows, C)),
                      (block + 'attn.qkv.bias', rand(qkv_rows)),
                      (block + 'attn.proj.weight', rand(C, proj_in)),
                      (block + 'attn.proj.bias', rand(C)),
                      (block + 'norm2.weight', rand(C)), (block + 'norm2.bias', rand(C)),
                      (block + 'mlp.fc1.weight', rand(2 * C, C)),
                      (block + 'mlp.fc1.bias', rand(2 * C)),
                      (block + 'mlp.fc2.weight', rand(C, 2 * C)),
                      (block + 'mlp.fc2.bias', rand(C))])
    state.update([('norm.weight', rand(C)), ('norm.bias', rand(C)), ('head.weight', rand(10, C)),
                  ('head.bias', rand(10))])
    return state


def vit3_release():
    """LeapLabTHU/ViTTT vittt.py: no class token or position embedding; a cpe conv before each
    block; TTT attention with qkv of 3C + 3d rows, inner weights w1, w2, w3 and a proj of
    C + d inputs. Saved as {'model': ...}."""
    state = softmax_vit_state(cls_token=False, pos_embed=False, qkv_rows=3 * C + 3 * D,
                              proj_in=C + D)
    for i in range(DEPTH):
        state.update([(f'blocks.{i}.cpe.weight', rand(C, 1, 3, 3)),
                      (f'blocks.{i}.cpe.bias', rand(C)),
                      (f'blocks.{i}.attn.w1', rand(1, HEADS, D, D)),
                      (f'blocks.{i}.attn.w2', rand(1, HEADS, D, D)),
                      (f'blocks.{i}.attn.w3', rand(D, 1, 3, 3))])
    return {'model': state, 'epoch': 299}


def inline_release():
    """LeapLabTHU/InLine inline_deit.py: a DeiT with attn.residual (two grouped 1x1 Conv1d)."""
    state = softmax_vit_state()
    for i in range(DEPTH):
        state.update([(f'blocks.{i}.attn.residual.0.weight', rand(C, C // HEADS, 1)),
                      (f'blocks.{i}.attn.residual.0.bias', rand(C)),
                      (f'blocks.{i}.attn.residual.2.weight', rand(9 * C, C // HEADS, 1)),
                      (f'blocks.{i}.attn.residual.2.bias', rand(9 * C))])
    return {'model': state}


def mhla_release():
    """DAGroup-PKU/MHLA: timm ViT blocks whose attn is MHLA_Normed_Torch (own LayerNorm,
    to_qkv without bias, q/k RMSNorm, lepe 5x5 conv, the block mixing piece_attn.conv,
    to_out)."""
    state = softmax_vit_state()
    for i in range(DEPTH):
        attn = f'blocks.{i}.attn.'
        for name in ('qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias'):
            del state[attn + name]
        state.update([(attn + 'norm.weight', rand(C)), (attn + 'norm.bias', rand(C)),
                      (attn + 'to_qkv.weight', rand(3 * C, C)),
                      (attn + 'q_norm.weight', rand(C)), (attn + 'k_norm.weight', rand(C)),
                      (attn + 'lepe.weight', rand(C, 1, 5, 5)), (attn + 'lepe.bias', rand(C)),
                      (attn + 'piece_attn.conv.weight', rand(4, 4, 1, 1)),
                      (attn + 'to_out.0.weight', rand(C, C)), (attn + 'to_out.0.bias', rand(C))])
    return state


def lolcats_maps():
    """HazyResearch/lolcats feature maps (untied_head_einsum) in a ViT's attention."""
    state = softmax_vit_state()
    for i in range(DEPTH):
        for side in 'qk':
            state[f'blocks.{i}.attn.feature_map_{side}.mlp.layer'] = rand(HEADS, D, D)
    return state


def linvit_state(attn_type, record):
    torch.manual_seed(0)
    vit = LinearViT(arch=ARCH, attn_type=attn_type, img_size=PATCH * GRID, patch_size=PATCH)
    checkpoint = dict(state_dict={f'backbone.{k}': v for k, v in vit.state_dict().items()},
                      meta={})
    if record:
        checkpoint['meta'][RECORD_KEY] = dict(backbones={'backbone.': describe_linear_vit(vit)})
    return checkpoint


# family -> (checkpoint, the operator of a model whose shapes it fits, a word the error names)
LINEAR = {
    'vit3': (vit3_release, 'ttt', 'ViT³'),
    'inline': (inline_release, 'inline', 'InLine'),
    'mhla': (mhla_release, 'mhla', 'MHLA'),
    'hedgehog': (lolcats_maps, 'hedgehog', 'LoLCATs'),
    'linvit_mm-record': (lambda: linvit_state('relu', record=True), 'relu', "['relu']"),
    'linvit_mm-ttt-keys': (lambda: linvit_state('ttt', record=False), 'ttt', 'ttt operator'),
}


def student(attn_type):
    torch.manual_seed(1)
    return LinearViT(arch=ARCH, attn_type=attn_type, img_size=PATCH * GRID, patch_size=PATCH)


@pytest.mark.parametrize('case', LINEAR)
def test_a_linear_source_is_refused_by_name_and_nothing_is_copied(case, refuses):
    make, attn_type, word = LINEAR[case]
    family = case.split('-')[0]
    source = next(s for s in LINEAR_SOURCES if s.name == family)
    message = refuses(student(attn_type), make(), setting='fullcopy', num_heads=HEADS)
    assert word in message and source.repository in message
    assert 'not a Softmax ViT' in message and source.instead in message


@pytest.mark.parametrize('case', LINEAR)
def test_detect_linear_source_names_the_family_and_its_keys(case):
    make, _, _ = LINEAR[case]
    match = detect_linear_source(make())
    assert match.source.name == case.split('-')[0]
    if case == 'linvit_mm-record':
        assert match.attn_types == ['relu'] * DEPTH and match.keys == []
    else:
        assert match.keys and all(key.split('.')[-1] != 'qkv' for key in match.keys)


def test_the_keys_found_are_every_tensor_of_the_family():
    assert detect_linear_source(vit3_release()).keys == [
        f'blocks.{i}.{name}' for i in range(DEPTH)
        for name in ('cpe.weight', 'cpe.bias', 'attn.w1', 'attn.w2', 'attn.w3')]
    # LoLCATs' own checkpoints are Llama decoders; the maps are told there too
    llama = {'model.layers.3.self_attn.feature_map_k.mlp.layer': rand(2, 4, 4),
             'model.layers.3.self_attn.q_proj.weight': rand(8, 8)}
    assert detect_linear_source(llama).source.name == 'hedgehog'


@pytest.mark.parametrize('case', ['deit', 'eva02-sub-ln', 'softmax-linvit-record',
                                  'lucidrains-to-qkv'])
def test_softmax_checkpoints_are_not_taken_for_linear_ones(case):
    if case == 'deit':
        checkpoint = {'model': softmax_vit_state()}
    elif case == 'eva02-sub-ln':
        # timm's EVA-02 attention names its sub-LN attn.norm, as MHLA names its first norm
        checkpoint = softmax_vit_state()
        checkpoint['blocks.0.attn.norm.weight'] = rand(C)
    elif case == 'softmax-linvit-record':
        checkpoint = linvit_state('softmax', record=True)
    else:
        checkpoint = {'transformer.layers.0.0.to_qkv.weight': rand(3 * C, C)}
    assert detect_linear_source(checkpoint) is None


def test_the_distillation_teacher_refuses_a_linear_checkpoint(tmp_path):
    path = tmp_path / 'vit3.pth'
    torch.save(vit3_release(), path)
    teacher = dict(type='LinearViT', arch=ARCH, attn_type='softmax', img_size=PATCH * GRID,
                   patch_size=PATCH, init_cfg=dict(type='SoftmaxTransfer', checkpoint=str(path),
                                                   setting='fullcopy'))
    hook = AttentionDistillHook(teacher=teacher)
    with pytest.raises(ValueError, match=r'ViT³ .*LeapLabTHU/ViTTT.*not a Softmax ViT'):
        hook.build_teacher('cpu')


def test_the_description_names_four_keys_of_a_kind_at_most():
    from linvit_mm.transfer.linear_sources import LinearSourceMatch
    inline = next(source for source in LINEAR_SOURCES if source.name == 'inline')
    keys = [f'blocks.{i}.attn.residual.0.weight' for i in range(5)]
    assert LinearSourceMatch(inline, keys).describe() == (
        'it holds 5 such tensor(s): ' + ', '.join(keys[:4])
        + ', ... (local residual branch attn.residual)')
    assert LinearSourceMatch(inline, keys[:4]).describe() == (
        'it holds 4 such tensor(s): ' + ', '.join(keys[:4])
        + ' (local residual branch attn.residual)')


def test_tensors_are_looked_for_two_mappings_deep():
    """A checkpoint's own top level and the mappings it holds (``state_dict``, ``model``,
    ``teacher``) and theirs: deeper nesting is no checkpoint layout."""
    def nested(levels):
        holder = {'blocks.0.attn.residual.0.weight': torch.zeros(1)}
        for level in range(levels):
            holder = {f'level{level}': holder}
        return holder
    assert detect_linear_source(nested(0)) is not None
    assert detect_linear_source(nested(2)).keys == ['blocks.0.attn.residual.0.weight']
    assert detect_linear_source(nested(3)) is None


def test_detect_linear_source_takes_a_mapping_only():
    with pytest.raises(TypeError, match='detect_linear_source expects a checkpoint mapping, got '
                                        'list'):
        detect_linear_source([])
