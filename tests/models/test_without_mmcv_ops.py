"""linvit_mm.models without mmcv's compiled ops (mmcv-lite, a bare GPU machine): the operators,
LinearViT and the plain pyramid import and run; only the adapter's deformable attention needs
mmcv.ops, and says so when built."""
import subprocess
import sys
import textwrap

# Blocks mmcv.ops and mmcv._ext as mmcv-lite lacks them, then uses the models.
SCRIPT = textwrap.dedent('''
    import importlib.abc, sys

    class NoCompiledOps(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name in ('mmcv.ops', 'mmcv._ext') or name.startswith('mmcv.ops.'):
                raise ModuleNotFoundError(f'No module named {name!r}', name=name)
            return None

    sys.meta_path.insert(0, NoCompiledOps())
    import torch
    import linvit_mm.models
    from mmpretrain.registry import MODELS
    from linvit_mm.models.attention import attention_types
    assert 'mmcv.ops' not in sys.modules
    for attn_type in attention_types():
        vit = MODELS.build(dict(type='LinearViT', attn_type=attn_type, img_size=32, patch_size=8,
                                arch=dict(embed_dims=32, num_layers=1, num_heads=2,
                                          feedforward_channels=64)))
        vit(torch.randn(1, 3, 32, 32))[-1].sum().backward()
    pyramid = MODELS.build(dict(type='LinearViTPlainPyramid', norm_cfg=dict(type='BN'),
                                vit=dict(attn_type='relu', img_size=64,
                                         arch=dict(embed_dims=64, num_layers=4, num_heads=2,
                                                   feedforward_channels=128))))
    assert len(pyramid(torch.randn(1, 3, 64, 64))) == 4
    try:
        MODELS.build(dict(type='LinearViTAdapter', conv_inplane=16, deform_num_heads=2,
                          deform_ratio=1.0,
                          interaction_indexes=[[0, 0], [1, 1], [2, 2], [3, 3]],
                          vit=dict(attn_type='relu', img_size=64,
                                   arch=dict(embed_dims=64, num_layers=4, num_heads=2,
                                             feedforward_channels=128))))
    except ImportError as err:
        print('REFUSED', err)
    print('OK')
''')


def test_models_import_and_run_without_compiled_mmcv_ops():
    run = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.rstrip().endswith('OK')
    assert "REFUSED the ViT-Adapter's multi-scale deformable attention needs mmcv's compiled " \
           "ops" in run.stdout
    assert 'not mmcv-lite' in run.stdout
