"""Fixtures of the analysis tests: tiny student configs over the mini ImageNet set, their
checkpoints (state dicts of the built classifier, no Runner) and Softmax teachers."""
from pathlib import Path

import pytest
import torch

TINY_CONFIG = Path(__file__).resolve().parents[1] / 'data' / 'configs' / 'tiny_cls_mini.py'
ARCH2 = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
ARCH4 = dict(ARCH2, num_layers=4)


def _linear_vit(attn_type='softmax', arch=ARCH2, seed=0, **kwargs):
    from linvit_mm.models import LinearViT
    torch.manual_seed(seed)
    return LinearViT(arch=arch, attn_type=attn_type, img_size=32, patch_size=8,
                     **kwargs).eval()


@pytest.fixture
def tiny_vit():
    """``tiny_vit(attn_type='softmax', arch=ARCH2, seed=0, **kwargs)``: a LinearViT of 32x32
    images in 8x8 patches, in eval mode, initialised with ``seed`` (the same seed gives the
    same shared tensors whatever the operator)."""
    return _linear_vit


@pytest.fixture(scope='session')
def teacher4_ckpt(tmp_path_factory):
    """A 4-block Softmax backbone's state dict."""
    path = tmp_path_factory.mktemp('teacher4') / 'teacher.pth'
    torch.save(_linear_vit(arch=ARCH4).state_dict(), path)
    return path


@pytest.fixture
def make_student(tmp_path, mini_data_root):
    """``make_student(attn_type, teacher, arch=ARCH2, with_hook=True)`` -> ``(config,
    checkpoint)``: a classifier of ``TINY_CONFIG`` with the teacher's blocks where they fit
    (its operator's own tensors and the head random) and, with ``with_hook``, an
    AttentionDistillHook whose teacher loads ``teacher``."""
    from mmengine.config import Config

    from linvit_mm.analysis import build_model

    def make(attn_type, teacher, arch=ARCH2, with_hook=True, name='student'):
        root = mini_data_root / 'imagenet'
        hook_teacher = dict(type='LinearViT', arch=arch, attn_type='softmax', img_size=32,
                            patch_size=8, init_cfg=dict(type='Pretrained',
                                                        checkpoint=str(teacher)))
        lines = [
            f"_base_ = ['{TINY_CONFIG}']",
            f'model = dict(backbone=dict(arch={arch!r}, attn_type={attn_type!r}))',
            "custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'])",
            f"val_dataloader = dict(dataset=dict(data_root='{root}'))",
            f"test_dataloader = dict(dataset=dict(data_root='{root}'))",
        ]
        if with_hook:
            lines.append(f"custom_hooks = [dict(type='AttentionDistillHook', "
                         f"teacher={hook_teacher!r})]")
        config = tmp_path / f'{name}.py'
        config.write_text('\n'.join(lines) + '\n')
        cfg = Config.fromfile(str(config))
        torch.manual_seed(1)
        model = build_model(dict(cfg.model, data_preprocessor=cfg.data_preprocessor))
        model.init_weights()
        own = model.backbone.state_dict()
        weights = torch.load(teacher, weights_only=True)
        model.backbone.load_state_dict(
            {k: v for k, v in weights.items() if k in own and v.shape == own[k].shape},
            strict=False)
        checkpoint = tmp_path / f'{name}.pth'
        torch.save(dict(state_dict=model.state_dict(), meta={}), checkpoint)
        return config, checkpoint

    return make
