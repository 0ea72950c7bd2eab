"""linvit_mm.analysis.fidelity: the agreement measure on known tensors, the per-block
recorder and comparison on tiny LinearViTs, the token rule, and the images it reads."""
import pytest
import torch
from torch import nn

from linvit_mm.analysis import (Agreement, BlockRecorder, compare_blocks, image_files,
                                load_config, packed_samples, preprocessed_batches,
                                uses_patch_tokens_only)

PATCHES = (32 // 8)**2


# ------------------------------------------------------------------ Agreement
@pytest.fixture
def teacher_tokens():
    torch.manual_seed(0)
    return torch.randn(2, 5, 4, dtype=torch.float64)


@pytest.mark.parametrize('transform, cosine, rel_mse', [
    (lambda t: t, 1., 0.),
    (lambda t: 2 * t, 1., 1.),
    (lambda t: -t, -1., 4.),
    (lambda t: torch.stack([-t[..., 1], t[..., 0], -t[..., 3], t[..., 2]], dim=-1), 0., 2.),
], ids=['same', 'twice', 'opposite', 'orthogonal'])
def test_agreement_of_known_pairs(teacher_tokens, transform, cosine, rel_mse):
    agreement = Agreement()
    agreement.add(transform(teacher_tokens), teacher_tokens)
    assert agreement.tokens == 2 * 5
    assert agreement.cosine == pytest.approx(cosine, abs=1e-12)
    assert agreement.rel_mse == pytest.approx(rel_mse, abs=1e-12)


def test_agreement_sums_over_batches_before_dividing(teacher_tokens):
    """relMSE is the error of all tokens over the norm of all tokens, not a mean of
    per-batch ratios; cos is the mean over all tokens."""
    small, large = teacher_tokens[:1], 3 * teacher_tokens[1:]
    agreement = Agreement()
    agreement.add(small, small)  # no error, cos 1
    agreement.add(-large, large)  # error 4 |large|^2, cos -1
    assert agreement.tokens == 10
    assert agreement.cosine == pytest.approx(0., abs=1e-12)
    norm_small, norm_large = small.pow(2).sum().item(), large.pow(2).sum().item()
    assert agreement.rel_mse == pytest.approx(4 * norm_large / (norm_small + norm_large))


def test_agreement_refuses_outputs_of_other_shapes():
    with pytest.raises(ValueError, match=r'student \(1, 4, 8\) and teacher \(1, 5, 8\)'):
        Agreement().add(torch.zeros(1, 4, 8), torch.zeros(1, 5, 8))


def test_agreement_with_a_zero_teacher_is_finite():
    agreement = Agreement()
    agreement.add(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))
    assert agreement.rel_mse == 0


# ------------------------------------------------------------------ recorder and comparison
def test_recorder_keeps_outputs_and_leaves_no_hooks(tiny_vit):
    backbone = tiny_vit(['relu', 'softmax'])
    recorder = BlockRecorder(backbone)
    assert recorder.operators == ['relu', 'softmax']
    with torch.no_grad():
        backbone(torch.randn(2, 3, 32, 32))
        expected_attn = backbone.layers[1].attn(backbone.layers[1].ln1(recorder.block[0]),
                                                  (4, 4))
    assert sorted(recorder.attn) == sorted(recorder.block) == [0, 1]
    assert torch.allclose(recorder.attn[1], expected_attn)  # the output, after projection
    assert recorder.block[1].shape == (2, PATCHES + 1, 32)
    recorder.clear()
    assert not recorder.attn and not recorder.block
    recorder.remove()
    assert not any(module._forward_hooks for module in backbone.modules())


def test_recorder_refuses_a_block_without_one_operator_and_unhooks(tiny_vit):
    backbone = tiny_vit('relu')
    backbone.layers.append(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r'block 2 holds 0 attention operators'):
        BlockRecorder(backbone)
    assert not any(module._forward_hooks for module in backbone.modules())


def batches_of(count=2, size=3):
    torch.manual_seed(3)
    return [torch.randn(size, 3, 32, 32) for _ in range(count)]


def test_a_copy_of_the_teacher_agrees_exactly(tiny_vit):
    rows = compare_blocks(tiny_vit('softmax'), tiny_vit('softmax'), batches_of(), False)
    assert [row['block'] for row in rows] == [0, 1]
    for row in rows:
        assert row['operator'] == 'softmax'
        assert row['cos_attn'] == pytest.approx(1, abs=1e-9)
        assert row['cos_block'] == pytest.approx(1, abs=1e-9)
        assert row['relmse_attn'] == row['relmse_block'] == 0
        assert row['tokens'] == 2 * 3 * (PATCHES + 1)


def test_a_hybrid_differs_from_the_block_its_operator_differs_in(tiny_vit):
    """The teacher's weights with relu in block 1: block 0 (its attention and its output)
    is the teacher's exactly; block 1's attention output differs, and so its block output."""
    rows = compare_blocks(tiny_vit(['softmax', 'relu']), tiny_vit('softmax'), batches_of(),
                          False)
    assert [row['operator'] for row in rows] == ['softmax', 'relu']
    assert rows[0]['relmse_attn'] == rows[0]['relmse_block'] == 0
    assert rows[1]['relmse_attn'] > 1e-3 and rows[1]['cos_attn'] < 0.999
    assert 0 < rows[1]['relmse_block'] < rows[1]['relmse_attn']


@pytest.mark.parametrize('attn_type, patch_only, tokens', [
    ('relu', False, PATCHES + 1),
    ('relu', True, PATCHES),
    ('mhla', True, PATCHES),
], ids=['class-token-kept', 'patch-tokens-asked', 'no-class-token'])
def test_compared_tokens(tiny_vit, attn_type, patch_only, tokens):
    rows = compare_blocks(tiny_vit(attn_type), tiny_vit('softmax'), batches_of(1, 2),
                          patch_only)
    assert all(row['tokens'] == 2 * tokens for row in rows)


def test_a_teacher_that_does_not_fit_is_refused_naming_each_problem(tiny_vit):
    deeper = tiny_vit('softmax', arch=dict(embed_dims=32, num_layers=3, num_heads=4,
                                           feedforward_channels=64))
    with pytest.raises(ValueError) as info:
        compare_blocks(tiny_vit('relu'), deeper, batches_of(1, 1), False)
    message = str(info.value)
    assert message.startswith('the teacher cannot be compared with the student')
    assert 'the student has 2 blocks, the teacher 3' in message
    assert 'head count (num_heads) differs' in message


def test_a_non_softmax_teacher_may_be_measured(tiny_vit):
    rows = compare_blocks(tiny_vit('relu'), tiny_vit('relu'), batches_of(1, 1), False)
    assert rows[0]['relmse_attn'] == 0


@pytest.mark.parametrize('student, teacher, hook, expected', [
    (dict(), dict(), None, False),
    (dict(), dict(), dict(patch_tokens_only=True), True),
    (dict(attn_type='mhla'), dict(), None, True),
    (dict(), dict(num_register_tokens=2), {}, True),
], ids=['same-tokens', 'asked', 'student-without-class-token', 'teacher-with-registers'])
def test_the_hook_s_token_rule(tiny_vit, student, teacher, hook, expected):
    student = tiny_vit(student.pop('attn_type', 'relu'), **student)
    assert uses_patch_tokens_only(student, tiny_vit('softmax', **teacher), hook) is expected


# ------------------------------------------------------------------ images
def test_image_files_from_files_and_folders(tmp_path):
    (tmp_path / 'set' / 'b').mkdir(parents=True)
    for name in ('set/b/2.png', 'set/1.JPG', 'set/notes.txt', 'single.bmp'):
        (tmp_path / name).write_bytes(b'')
    found = image_files([str(tmp_path / 'set'), str(tmp_path / 'single.bmp')])
    assert found == [str(tmp_path / 'set' / '1.JPG'), str(tmp_path / 'set' / 'b' / '2.png'),
                     str(tmp_path / 'single.bmp')]


def test_image_files_refuses_missing_paths_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match='nowhere is neither a file nor a folder'):
        image_files([str(tmp_path / 'nowhere')])
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match='no images .* under .*empty'):
        image_files([str(tmp_path / 'empty')])


def test_samples_of_the_validation_set_or_of_files(make_student, teacher_ckpt, mini_data_root):
    from linvit_mm.analysis import load_student
    config, checkpoint = make_student('relu', teacher_ckpt)
    cfg = load_config(str(config))
    assert len(packed_samples(cfg, num_images=3)) == 3
    folder = mini_data_root / 'imagenet' / 'val' / 'circle'
    samples = packed_samples(cfg, images=[str(folder)])
    assert len(samples) == len(list(folder.iterdir())) > 0
    model = load_student(cfg, str(checkpoint), 'cpu')
    batches = list(preprocessed_batches(model, samples[:3], 2, 'cpu'))
    assert [batch.shape for batch in batches] == [(2, 3, 32, 32), (1, 3, 32, 32)]
    # the config's normalisation, not raw pixels
    assert batches[0].mean().abs() < 5 and batches[0].dtype == torch.float32
