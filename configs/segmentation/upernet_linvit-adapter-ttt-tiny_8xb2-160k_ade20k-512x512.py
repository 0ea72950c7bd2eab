_base_ = [
    '../_base_/models/upernet_linvit-adapter.py',
    'mmseg::_base_/datasets/ade20k.py',
    '../_base_/schedules/ade20k_adamw_160k_linvit.py',
    'mmseg::_base_/default_runtime.py',
]

# Classification-stage checkpoint: what
#   tools/train.py configs/classification/imagenet/linvit-ttt-tiny_fullcopy-distill_32xb128_in1k.py
# writes by default (override: --cfg-options model.backbone.pretrained=PATH).
linvit_checkpoint = 'work_dirs/linvit-ttt-tiny_fullcopy-distill_32xb128_in1k/epoch_300.pth'
model = dict(
    backbone=dict(
        vit=dict(arch='tiny', attn_type='ttt', drop_path_rate=0.1),
        pretrained=linvit_checkpoint),
    decode_head=dict(in_channels=[192, 192, 192, 192]),
    auxiliary_head=dict(in_channels=192))
# 8 GPUs x 2 images; multi-scale test: tools/test.py CONFIG CKPT --tta
train_dataloader = dict(batch_size=2)
optim_wrapper = dict(optimizer=dict(lr=12e-5))
