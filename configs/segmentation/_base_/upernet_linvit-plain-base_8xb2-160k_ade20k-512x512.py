# UperNet, ADE20K 160k, on a plain LinearViT-Base with ViT-Adapter's simple pyramid: the
# paper's dense protocol (its plain-ViT baseline of ViT-Adapter, global attention).
# ViT-Adapter publishes no plain-ViT ADE20K config: the schedule and drop path are those of
# the Base adapter recipe here. A config names the attention operator and the ImageNet-stage
# checkpoint of the same operator and size; see README.md in the folder above.
_base_ = [
    '../../_base_/models/upernet_linvit-plain.py',
    'mmseg::_base_/datasets/ade20k.py',
    '../../_base_/schedules/ade20k_adamw_160k_linvit.py',
    'mmseg::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(vit=dict(arch='base', drop_path_rate=0.3)),
    decode_head=dict(in_channels=[768, 768, 768, 768]),
    auxiliary_head=dict(in_channels=768))
# 8 GPUs x 2 images; multi-scale test: tools/test.py CONFIG CKPT --tta
train_dataloader = dict(batch_size=2)
