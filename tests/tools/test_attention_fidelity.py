"""The command line of tools/analysis_tools/attention_fidelity.py on tiny LinearViTs and the
mini ImageNet set (its logic: tests/analysis/test_fidelity.py and test_student_teacher.py).

Student checkpoints are real mmengine run checkpoints: one iteration of the Runner with
lr 0 (AdamW then leaves every weight as it was), so a student initialised from the
teacher's weights stays identical to it.
"""
import csv
import importlib.util
import re
from pathlib import Path

import pytest
from mmengine.config import Config
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
PATCHES = (32 // 8)**2
NUM_IMAGES = 3


def load_tool():
    # the tool is a script: its main is run as the command line runs it
    path = REPO / 'tools' / 'analysis_tools' / 'attention_fidelity.py'
    spec = importlib.util.spec_from_file_location('attention_fidelity', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()


def write_config(path, mini_data_root, teacher_ckpt, attn_type, from_teacher=False,
                 with_hook=True):
    root = mini_data_root / 'imagenet'
    teacher = dict(type='LinearViT', arch=ARCH, attn_type='softmax', img_size=32, patch_size=8,
                   init_cfg=dict(type='Pretrained', checkpoint=str(teacher_ckpt)))
    backbone = dict(attn_type=attn_type)
    if from_teacher:
        backbone['init_cfg'] = dict(type='Pretrained', checkpoint=str(teacher_ckpt))
    lines = [
        f"_base_ = ['{TINY_CONFIG}']",
        f'model = dict(backbone={backbone!r})',
        "custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'])",
        f"train_dataloader = dict(dataset=dict(data_root='{root}'))",
        f"val_dataloader = dict(dataset=dict(data_root='{root}'))",
        f"test_dataloader = dict(dataset=dict(data_root='{root}'))",
    ]
    if with_hook:
        lines.append(f"custom_hooks = [dict(type='AttentionDistillHook', teacher={teacher!r})]")
    path.write_text('\n'.join(lines) + '\n')
    return path


def run_checkpoint(config, work_dir):
    """One Runner iteration at lr 0: a genuine run checkpoint with unchanged weights."""
    cfg = Config.fromfile(str(config))
    cfg.work_dir = str(work_dir)
    cfg.optim_wrapper.optimizer.lr = 0.
    cfg.train_cfg.max_iters = 1
    cfg.train_cfg.val_interval = 10  # no validation
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1, by_epoch=False)
    Runner.from_cfg(cfg).train()
    return work_dir / 'iter_1.pth'


@pytest.fixture(scope='module')
def students(tmp_path_factory, mini_data_root, teacher_ckpt):
    """config and checkpoint of: a softmax copy of the teacher, a relu and an mhla student."""
    made = {}
    for name, attn_type, from_teacher in (('copy', 'softmax', True), ('relu', 'relu', False),
                                          ('mhla', 'mhla', False)):
        base = tmp_path_factory.mktemp(name)
        config = write_config(base / f'{name}.py', mini_data_root, teacher_ckpt, attn_type,
                              from_teacher)
        made[name] = (config, run_checkpoint(config, base / 'work'))
    return made


def run_tool(config, checkpoint, out_dir, *extra):
    return tool.main([str(config), str(checkpoint), '--num-images', str(NUM_IMAGES),
                          '--out-dir', str(out_dir), *map(str, extra)])


def test_copy_of_the_teacher_agrees_exactly(students, tmp_path, capsys):
    rows = run_tool(*students['copy'], tmp_path)
    batches = -(-NUM_IMAGES // 4)  # the default batch size
    assert f'] {batches}/{batches}, ' in capsys.readouterr().out  # mmengine's progress bar
    assert [row['block'] for row in rows] == [0, 1]
    for row in rows:
        assert row['cos_attn'] == pytest.approx(1, abs=1e-9)
        assert row['cos_block'] == pytest.approx(1, abs=1e-9)
        assert row['relmse_attn'] == 0 and row['relmse_block'] == 0
        assert row['tokens'] == NUM_IMAGES * (PATCHES + 1)  # class token kept
    with open(tmp_path / 'fidelity.csv') as f:
        written = list(csv.DictReader(f))
    assert [r['block'] for r in written] == ['0', '1']
    assert float(written[1]['relmse_block']) == 0
    assert (tmp_path / 'fidelity.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('name, tokens', [('relu', PATCHES + 1), ('mhla', PATCHES)],
                         ids=['relu-all-tokens', 'mhla-patch-tokens'])
def test_different_student_agrees_less(students, tmp_path, name, tokens):
    rows = run_tool(*students[name], tmp_path)
    for row in rows:
        # Runner and teacher share seed 0, so the embeddings agree and the residual
        # stream differs only by what the attention adds: small but not zero.
        assert row['cos_attn'] < 0.99 and row['relmse_attn'] > 1e-2
        assert row['cos_block'] < 1 - 1e-6 and row['relmse_block'] > 1e-9
        assert row['tokens'] == NUM_IMAGES * tokens


def test_teacher_checkpoint_override_reads_a_run_checkpoint(students, tmp_path):
    """The copy student's run checkpoint holds the teacher under backbone.*: same teacher."""
    default = run_tool(*students['relu'], tmp_path / 'default')
    overridden = run_tool(*students['relu'], tmp_path / 'override', '--teacher-checkpoint',
                          students['copy'][1])
    for a, b in zip(default, overridden):
        for key in ('cos_attn', 'relmse_attn', 'cos_block', 'relmse_block'):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key


def test_teacher_config_and_image_folder(students, tmp_path, mini_data_root, teacher_ckpt):
    """A student config without the hook, the teacher from another config's classifier."""
    config = write_config(tmp_path / 'plain.py', mini_data_root, teacher_ckpt, 'softmax',
                          with_hook=False)
    teacher_config, teacher_run = students['copy']
    folder = mini_data_root / 'imagenet' / 'val' / 'circle'
    rows = tool.main([str(config), str(teacher_run), '--teacher-config', str(teacher_config),
                          '--teacher-checkpoint', str(teacher_run), '--images', str(folder),
                          '--out-dir', str(tmp_path / 'out')])
    images = len(list(folder.iterdir()))
    assert images > 0 and rows[0]['tokens'] == images * (PATCHES + 1)
    assert all(row['relmse_attn'] == 0 for row in rows)

    with pytest.raises(ValueError, match='no AttentionDistillHook'):
        tool.main([str(config), str(teacher_run), '--num-images', '1', '--out-dir',
                       str(tmp_path / 'refused')])


def test_student_checkpoint_must_fit(students, tmp_path):
    config, _ = students['mhla']
    _, relu_checkpoint = students['relu']  # mhla has no class token / other parameters
    with pytest.raises(ValueError, match='does not fit the model'):
        run_tool(config, relu_checkpoint, tmp_path)


def test_a_hybrid_student_shows_each_block_s_operator(tmp_path, mini_data_root, teacher_ckpt,
                                                      capsys):
    """The teacher's weights in a [softmax, relu] hybrid: block 0 is the teacher's block on
    the teacher's input (exact), block 1 is not."""
    config = write_config(tmp_path / 'hybrid.py', mini_data_root, teacher_ckpt,
                          ['softmax', 'relu'], from_teacher=True)
    rows = run_tool(config, run_checkpoint(config, tmp_path / 'work'), tmp_path / 'out')
    assert [row['operator'] for row in rows] == ['softmax', 'relu']
    assert rows[0]['relmse_attn'] == 0 and rows[0]['relmse_block'] == 0
    assert rows[1]['relmse_attn'] > 1e-6
    printed = capsys.readouterr().out
    assert re.search(r'^\s+0\s+softmax\s+1\.00000', printed, flags=re.M)
    assert 'student: relu+softmax@0 backbone' in printed
    with open(tmp_path / 'out' / 'fidelity.csv') as f:
        assert [row['operator'] for row in csv.DictReader(f)] == ['softmax', 'relu']
