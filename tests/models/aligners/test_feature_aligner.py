"""FeatureAligner (stage 2 of the staged recipe): the whole student against the teacher's
output features."""
import pytest
import torch
import torch.nn.functional as F
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.testing.staged import teacher_cfg, tiny_vit_cfg, write_softmax_teacher


@pytest.fixture(scope='module')
def teacher_path(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('feat_teacher') / 'teacher.pth')


def build(teacher_path, attn_type='relu', student=None, teacher=None, **kwargs):
    model = MODELS.build(dict(
        type='FeatureAligner', backbone=student or tiny_vit_cfg(attn_type),
        teacher=teacher or teacher_cfg(teacher_path), **kwargs))
    model.init_weights()
    return model


def images(batch=2, seed=0):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize('attn_type, tokens', [('relu', 17), ('ttt', 16)])
def test_align_feat_losses_are_weighted_mse_and_cosine_of_final_tokens(attn_type, tokens,
                                                                        teacher_path):
    model = build(teacher_path, attn_type, mse_weight=2.0, cos_weight=0.5)
    x = images()
    (student, teacher), = model.level_pairs(x)
    assert student.shape == teacher.shape == (2, tokens, 32)
    # the teacher's final normed tokens (its last block output after ln1)
    with torch.no_grad():
        raw, hw = model.teacher.embed(x)
        for layer in model.teacher.layers:
            raw = layer(raw, hw)
        final = model.teacher.ln1(raw)
    torch.testing.assert_close(teacher, final[:, 17 - tokens:])
    # and the student's: its own final normed tokens, with the gradient path intact
    raw, hw = model.backbone.embed(x)
    for layer in model.backbone.layers:
        raw = layer(raw, hw)
    torch.testing.assert_close(student, model.backbone.ln1(raw))
    assert student.requires_grad
    losses = model(x, mode='loss')
    torch.testing.assert_close(losses['loss_feat_mse'], 2.0 * F.mse_loss(student, teacher))
    torch.testing.assert_close(losses['loss_feat_cos'],
                               0.5 * (1 - F.cosine_similarity(student, teacher, dim=-1)).mean())
    assert set(build(teacher_path, attn_type)(x, mode='loss')) == {'loss_feat_mse'}


def test_align_feat_out_indices_levels(teacher_path):
    model = build(teacher_path, 'relu', student=tiny_vit_cfg('relu', out_indices=[0, 2]),
                  features='out_indices')
    assert model.teacher.out_indices == [0, 2] and model.teacher.out_type == 'raw'
    pairs = model.level_pairs(images())
    assert len(pairs) == 2
    assert not torch.allclose(pairs[0][1], pairs[1][1])
    assert model.staged_record() == dict(stage='align-feat', features='out_indices')


def test_align_feat_trains_the_whole_student_not_the_teacher(teacher_path):
    model = build(teacher_path, 'mhla', cos_weight=1.0)
    sum(model(images(), mode='loss').values()).backward()
    assert all(p.grad is not None for p in model.backbone.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.teacher.parameters())
    assert not set(model.state_dict()) - {f'backbone.{k}' for k in model.backbone.state_dict()}


def test_align_feat_loss_decreases(teacher_path):
    model = build(teacher_path, 'relu')
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = images(batch=4)
    losses = []
    for _ in range(10):
        loss = model(x, mode='loss')['loss_feat_mse']
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses


def test_align_feat_refuses_bad_settings(teacher_path):
    with pytest.raises(ValueError, match='both 0'):
        build(teacher_path, mse_weight=0, cos_weight=0)
    with pytest.raises(ValueError, match='cos_weight must be a finite number >= 0'):
        build(teacher_path, cos_weight=-1)
    with pytest.raises(ValueError, match='features must be one of'):
        build(teacher_path, features='all')
    with pytest.raises(ValueError, match="features='out_indices' to align those levels"):
        build(teacher_path, student=tiny_vit_cfg('relu', out_indices=[0, 2]))
    with pytest.raises(ValueError, match="out_type='cls_token'"):
        build(teacher_path, student=tiny_vit_cfg('relu', out_type='cls_token'))
    with pytest.raises(ValueError, match=r"its config sets out_indices=\[1\]"):
        build(teacher_path, teacher=dict(teacher_cfg(teacher_path), out_indices=[1]))
    with pytest.raises(ValueError, match='student has 3 blocks, the teacher 2'):
        build(teacher_path, teacher=teacher_cfg(
            teacher_path, arch=dict(embed_dims=32, num_layers=2, num_heads=2,
                                    feedforward_channels=64)))
