# An ImageClassifier around a LinearViT of the DINOv2-S source; its Softmax checkpoint, teacher
# and FullCopy head come from softmax-dinov2-small.py.
_base_ = ['./linvit-classifier.py', './softmax-dinov2-small.py']

model = dict(
    backbone=dict(
        # the arch word sets what defines the source (patch size, registers, LayerScale,
        # RoPE, ...); patch_size=None leaves the patch size to it
        arch='dinov2-small',
        patch_size=None,
        drop_path_rate=0.0,
        # 'random' copies nothing; the setting configs change only the setting.
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint={{_base_.softmax_checkpoint}}, setting='random')),
    head=dict(in_channels=384))
