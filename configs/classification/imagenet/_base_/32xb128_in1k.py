# The ImageNet-1K recipe of the paper (Table B): data, schedule and runtime. A config adds
# a size base (the model, its DeiT checkpoint and its teacher) and names the operator, the
# setting and, for "-distill", the hook; see README.md in the folder above.
_base_ = [
    '../../../_base_/datasets/imagenet_bs128_linvit_224.py',
    '../../../_base_/schedules/imagenet_bs4096_adamw_300e_linvit.py',
    'mmpretrain::_base_/default_runtime.py',
]
