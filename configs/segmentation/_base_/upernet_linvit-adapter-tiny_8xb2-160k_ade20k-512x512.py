# UperNet, ADE20K 160k, with a ViT-Adapter around a LinearViT-Tiny. A config names the
# attention operator and the ImageNet-stage checkpoint of the same operator and size; see
# README.md in the folder above.
_base_ = [
    '../../_base_/models/upernet_linvit-adapter.py',
    'mmseg::_base_/datasets/ade20k.py',
    '../../_base_/schedules/ade20k_adamw_160k_linvit.py',
    'mmseg::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(vit=dict(arch='tiny', drop_path_rate=0.1)),
    decode_head=dict(in_channels=[192, 192, 192, 192]),
    auxiliary_head=dict(in_channels=192))
# 8 GPUs x 2 images; multi-scale test: tools/test.py CONFIG CKPT --tta
train_dataloader = dict(batch_size=2)
optim_wrapper = dict(optimizer=dict(lr=12e-5))
