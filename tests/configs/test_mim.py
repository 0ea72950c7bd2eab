"""``mim train linvit_mm`` / ``mim test linvit_mm`` on a demo config, found by its name.

mim finds the package's tools and configs under ``<package>/.mim`` (setup.py's mim extension,
and the install layout ``tools/setup_env.py`` makes for an editable install).
"""
import subprocess
import sys

import pytest

CONFIG = 'linvit-softmax-mini_random_1xb32_mini-shapes.py'  # configs/demo/


def mim(*args, cwd):
    return subprocess.run([sys.executable, '-m', 'mim', *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two tool runs in their own interpreters: about 40 s on 2 idle cores
def test_mim_trains_and_tests_a_config_of_the_package(mini_data_root, tmp_path):
    data = mini_data_root / 'imagenet'
    options = ['--cfg-options', *(f'{loader}.dataset.data_root={data}'
                                  for loader in ('train_dataloader', 'val_dataloader',
                                                 'test_dataloader')),
               'train_cfg.max_iters=2', 'train_cfg.val_interval=2',
               'default_hooks.checkpoint.interval=2', 'train_dataloader.batch_size=4']
    # run from a folder without the config: mim looks it up in the package's configs
    train = mim('train', 'linvit_mm', CONFIG, '--work-dir', tmp_path / 'work', *options,
                cwd=tmp_path)
    assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
    assert "we find the config file in codebase linvit_mm" in train.stdout
    assert 'Training finished successfully' in train.stdout
    checkpoint = tmp_path / 'work' / 'iter_2.pth'
    assert checkpoint.is_file()
    test = mim('test', 'linvit_mm', CONFIG, '--checkpoint', checkpoint, '--work-dir',
               tmp_path / 'test', *options, cwd=tmp_path)
    assert test.returncode == 0, (test.stdout + test.stderr)[-4000:]
    assert 'accuracy/top1' in test.stdout + test.stderr
