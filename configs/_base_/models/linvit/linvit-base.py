# An ImageClassifier around a ViT-Base-shaped LinearViT; its Softmax checkpoint, teacher
# and FullCopy head come from softmax-base.py.
_base_ = ['./linvit-classifier.py', './softmax-base.py']

model = dict(
    backbone=dict(
        arch='base',
        drop_path_rate=0.1,
        # 'random' copies nothing; the setting configs change only the setting.
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint={{_base_.softmax_checkpoint}}, setting='random')),
    head=dict(in_channels=768))
