_base_ = [
    '../../_base_/models/linvit/linvit-relu-small.py',
    '../../_base_/datasets/imagenet_bs128_linvit_224.py',
    '../../_base_/schedules/imagenet_bs4096_adamw_300e_linvit.py',
    'mmpretrain::_base_/default_runtime.py',
]
