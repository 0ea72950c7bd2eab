"""tools/model_converters/softmax_vit_to_mmpretrain.py: converts, states the head count, and
never overwrites its source."""
import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linvit_mm.transfer import load_softmax_checkpoint

REPO = Path(__file__).resolve().parents[2]
CONVERTER = REPO / 'tools' / 'model_converters' / 'softmax_vit_to_mmpretrain.py'
ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=128)


def load_tool():
    spec = importlib.util.spec_from_file_location('softmax_vit_to_mmpretrain', CONVERTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


converter = load_tool()


@pytest.fixture(scope='module')
def deit_file(tmp_path_factory):
    """A small ViT in the DeiT release layout (``{'model': timm keys, 'args': ...}``)."""
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2,
                            mlp_ratio=4, num_classes=10)
    path = tmp_path_factory.mktemp('converter') / 'deit.pth'
    torch.save({'model': vit.state_dict(), 'args': argparse.Namespace(lr=5e-4)}, path)
    return path


@pytest.mark.slow
def test_converter_cli_round_trip(deit_file, tmp_path):
    from mmpretrain.models.backbones import VisionTransformer
    dst = tmp_path / 'out' / 'deit_mmpretrain.pth'
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    result = subprocess.run([sys.executable, str(CONVERTER), str(deit_file), str(dst), '--show',
                             '--num-heads', '2'], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert 'source format   : deit-official' in result.stdout
    assert 'mapped tensors  : 32' in result.stdout
    assert 'num_heads       : 2 (given as num_heads=2)' in result.stdout
    assert 'backbone.layers.1.ffn.layers.1.weight: (32, 128)' in result.stdout

    converted = torch.load(dst, weights_only=True)
    meta = converted['meta']
    assert (meta['source_format'], meta['converted_by'], meta['num_heads']) == (
        'deit-official', 'linvit_mm', 2)
    # mmpretrain's own ViT takes the converted backbone as it is
    backbone = VisionTransformer(arch=ARCH, img_size=32, patch_size=16)
    backbone.load_state_dict({k[len('backbone.'):]: v for k, v in converted['state_dict'].items()
                              if k.startswith('backbone.')}, strict=True)
    assert set(converted['state_dict']) - {f'backbone.{k}' for k in backbone.state_dict()} == {
        'head.layers.head.weight', 'head.layers.head.bias'}

    again = load_softmax_checkpoint(dst)
    assert again.source_format == 'mmpretrain'
    assert (again.num_heads, again.num_heads_from) == (2, "meta['num_heads']=2")
    assert (again.pos_grid, again.num_extra_tokens) == ((2, 2), 1)
    assert again.unused_keys == []


def test_missing_source_is_an_error(tmp_path, capsys):
    assert converter.main([str(tmp_path / 'missing.pth'), str(tmp_path / 'out.pth')]) == 1
    assert 'missing.pth' in capsys.readouterr().err
    assert not (tmp_path / 'out.pth').exists()


def test_a_head_count_that_does_not_fit_writes_nothing(deit_file, tmp_path, capsys):
    dst = tmp_path / 'out.pth'
    assert converter.main([str(deit_file), str(dst), '--num-heads', '3']) == 1
    assert 'num_heads=3 does not divide' in capsys.readouterr().err
    assert not dst.exists()


@pytest.mark.parametrize('how', ['same-path', 'relative', 'symlink', 'hardlink'])
def test_dst_that_is_the_source_is_refused_before_reading(how, tmp_path, monkeypatch, capsys):
    # The source is not even a checkpoint: the refusal comes before anything is read.
    src = tmp_path / 'precious.pth'
    src.write_bytes(b'not read')
    dst = src
    if how == 'relative':
        monkeypatch.chdir(tmp_path)
        dst = Path('sub') / '..' / 'precious.pth'
        (tmp_path / 'sub').mkdir()
    elif how == 'symlink':
        dst = tmp_path / 'link.pth'
        dst.symlink_to(src)
    elif how == 'hardlink':
        dst = tmp_path / 'hard.pth'
        os.link(src, dst)
    assert converter.main([str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert 'is the source file' in err and 'Give another DST' in err
    assert src.read_bytes() == b'not read'


def test_a_release_converts_with_its_family_and_an_unknown_family_is_refused(tmp_path, capsys):
    import timm
    torch.manual_seed(0)
    dinov3 = timm.create_model('vit_small_patch16_dinov3', pretrained=False, img_size=32,
                               depth=1, embed_dim=64, num_heads=4)
    release = {('storage_tokens' if k == 'reg_token' else k.replace('gamma_', 'ls')
                .replace('ls1', 'ls1.gamma').replace('ls2', 'ls2.gamma')): v
               for k, v in dinov3.state_dict().items()}
    release['mask_token'] = torch.zeros(1, 64)
    src, dst = tmp_path / 'dinov3.pth', tmp_path / 'out.pth'
    torch.save(release, src)
    assert converter.main([str(src), str(dst), '--num-heads', '4']) == 0
    out = capsys.readouterr().out
    assert 'source format   : dinov3' in out
    assert "family          : dinov3 (its dinov3 release layout)" in out
    meta = torch.load(dst, weights_only=True)['meta']
    assert (meta['family'], meta['num_register_tokens'], meta['rope']) == ('dinov3', 4, 'dinov3')
    again = load_softmax_checkpoint(dst)
    assert (again.family, again.rope, again.num_register_tokens) == ('dinov3', 'dinov3', 4)

    assert converter.main([str(src), str(tmp_path / 'other.pth'), '--family', 'dinov4']) == 1
    err = capsys.readouterr().err
    assert "unknown source family 'dinov4'; known families are: dinov3:" in err
    assert not (tmp_path / 'other.pth').exists()
