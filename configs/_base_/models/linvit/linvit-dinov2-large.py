# An ImageClassifier around a LinearViT of the DINOv2-L source; its Softmax checkpoint, teacher
# and FullCopy head come from softmax-dinov2-large.py.
_base_ = ['./linvit-classifier.py', './softmax-dinov2-large.py']

model = dict(
    backbone=dict(
        # the arch word sets what defines the source (patch size, registers, LayerScale,
        # RoPE, ...); patch_size=None leaves the patch size to it
        arch='dinov2-large',
        patch_size=None,
        drop_path_rate=0.2,
        # 'random' copies nothing; the setting configs change only the setting.
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint={{_base_.softmax_checkpoint}}, setting='random')),
    head=dict(in_channels=1024))
