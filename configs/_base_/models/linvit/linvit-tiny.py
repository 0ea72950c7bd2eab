# An ImageClassifier around a ViT-Tiny-shaped LinearViT; its Softmax checkpoint, teacher
# and FullCopy head come from softmax-tiny.py.
_base_ = ['./linvit-classifier.py', './softmax-tiny.py']

model = dict(
    backbone=dict(
        arch='tiny',
        drop_path_rate=0.0,
        # 'random' copies nothing; the setting configs change only the setting.
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint={{_base_.softmax_checkpoint}}, setting='random')),
    head=dict(in_channels=192))
