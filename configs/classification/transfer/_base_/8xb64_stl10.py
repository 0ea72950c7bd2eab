# The transfer recipe of the paper (Table C) on STL-10: data, schedule and runtime.
# A config adds a size base and names the operator and the setting; its head takes
# num_classes, the data set's. See README.md in the folder above.
_base_ = [
    '../../../_base_/datasets/stl10_bs64_linvit_224.py',
    '../../../_base_/schedules/transfer_bs512_adamw_300e_linvit.py',
    'mmpretrain::_base_/default_runtime.py',
]

num_classes = {{_base_.data_preprocessor.num_classes}}
