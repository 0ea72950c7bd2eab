"""tools/model_converters/merge_aligned_blocks.py: per-block alignment jobs into one file."""
import importlib.util
from pathlib import Path

import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import RECORD_KEY, load_linear_vit_checkpoint
from linvit_mm.testing.staged import tiny_vit_cfg, write_recorded_checkpoint

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / 'tools' / 'model_converters' / 'merge_aligned_blocks.py'


def load_tool():
    spec = importlib.util.spec_from_file_location('merge_aligned_blocks', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()


@pytest.fixture()
def jobs(tmp_path):
    """Two alignment jobs of one tiny ttt ViT: blocks [0, 2] and [1]."""
    torch.manual_seed(0)
    base = MODELS.build(tiny_vit_cfg('ttt'))
    paths = {}
    for name, trained in (('a', [0, 2]), ('b', [1])):
        vit = MODELS.build(tiny_vit_cfg('ttt'))
        vit.load_state_dict(base.state_dict())
        with torch.no_grad():
            for index in trained:
                for param in vit.layers[index].attn.parameters():
                    param.add_(index + 1)
        paths[name] = write_recorded_checkpoint(tmp_path / f'{name}.pth', vit,
                                                stage='align-attn', trained_layers=trained)
    return paths


def test_merge_aligned_blocks_tool_writes_a_loadable_checkpoint(jobs, tmp_path, capsys):
    out = tmp_path / 'merged' / 'stage1.pth'
    assert tool.main([str(out), str(jobs['a']), str(jobs['b'])]) == 0
    assert 'merged 2 checkpoints (3 blocks)' in capsys.readouterr().out
    merged = torch.load(out, map_location='cpu', weights_only=True)
    assert merged['meta'][RECORD_KEY]['trained_layers'] == [0, 1, 2]
    vit = MODELS.build(tiny_vit_cfg('ttt'))
    load_linear_vit_checkpoint(vit, str(out))
    sources = {name: torch.load(path, weights_only=True)['state_dict']
               for name, path in jobs.items()}
    for key, value in vit.state_dict().items():
        owner = 'b' if key.startswith('layers.1.attn.') else 'a'
        assert torch.equal(value, sources[owner][f'backbone.{key}']), key


def test_merge_aligned_blocks_tool_refuses_and_writes_nothing(jobs, tmp_path, capsys):
    out = tmp_path / 'merged.pth'
    assert tool.main([str(out), str(jobs['a'])]) == 1
    assert 'at least two checkpoints' in capsys.readouterr().err
    assert tool.main([str(out), str(jobs['a']), str(jobs['a'])]) == 1
    assert 'given more than once' in capsys.readouterr().err
    assert tool.main([str(out), str(jobs['a']), str(jobs['a']).replace('a.pth', 'b.pth'),
                      str(jobs['a']).replace('a.pth', '../' + jobs['a'].parent.name + '/a.pth')
                      ]) == 1
    assert 'given more than once' in capsys.readouterr().err
    overlapping = write_recorded_checkpoint(
        tmp_path / 'c.pth', MODELS.build(tiny_vit_cfg('ttt')), stage='align-attn',
        trained_layers=[1, 2])
    assert tool.main([str(out), str(jobs['a']), str(overlapping)]) == 1
    assert 'block 2 is trained in more than one checkpoint' in capsys.readouterr().err
    assert tool.main([str(out), str(jobs['a']), str(tmp_path / 'missing.pth')]) == 1
    assert 'missing.pth' in capsys.readouterr().err
    assert not out.exists()
    assert tool.main([str(jobs['b']), str(jobs['a']), str(jobs['b'])]) == 1
    assert 'is one of the inputs' in capsys.readouterr().err


def test_merge_aligned_blocks_tool_refuses_a_job_holding_nan(jobs, tmp_path, capsys):
    checkpoint = torch.load(jobs['b'], weights_only=False)
    checkpoint['state_dict']['backbone.layers.1.attn.qkv.weight'][0, 0] = float('nan')
    torch.save(checkpoint, jobs['b'])
    out = tmp_path / 'merged.pth'
    assert tool.main([str(out), str(jobs['a']), str(jobs['b'])]) == 1
    err = capsys.readouterr().err
    assert f'{jobs["b"]}: 1 tensor(s) hold non-finite values' in err
    assert 'backbone.layers.1.attn.qkv.weight: 1 NaN of' in err
    assert not out.exists()


def test_merge_aligned_blocks_tool_names_a_truncated_job(jobs, tmp_path, capsys):
    data = jobs['b'].read_bytes()
    jobs['b'].write_bytes(data[:len(data) // 2])
    out = tmp_path / 'merged.pth'
    assert tool.main([str(out), str(jobs['a']), str(jobs['b'])]) == 1
    assert (f'alignment checkpoint {jobs["b"]} cannot be read, it is truncated or damaged'
            in capsys.readouterr().err)
    assert not out.exists()


def test_merge_aligned_blocks_tool_checks_out_before_reading_any_job(jobs, tmp_path, capsys):
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    # the second job cannot be read: the OUT error first shows that nothing was read
    jobs['b'].write_bytes(b'')
    assert tool.main([str(blocker / 'merged.pth'), str(jobs['a']), str(jobs['b'])]) == 1
    err = capsys.readouterr().err
    assert f'cannot be created: {blocker} is a file, not a directory' in err
    assert 'cannot be read' not in err
    assert tool.main([str(tmp_path), str(jobs['a']), str(jobs['b'])]) == 1
    assert f'OUT {tmp_path} is a directory' in capsys.readouterr().err
