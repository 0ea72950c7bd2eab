# An ImageClassifier around LinearViT. The size bases (linvit-{tiny,small,base}.py) set the
# width; the operator bases (linvit-{op}-{size}.py) set the attention operator.
custom_imports = dict(
    imports=[
        'linvit_mm.models', 'linvit_mm.engine', 'linvit_mm.transfer', 'linvit_mm.datasets',
        'linvit_mm.evaluation'
    ],
    allow_failed_imports=False)

model = dict(
    type='ImageClassifier',
    backbone=dict(
        type='LinearViT',
        arch='small',
        attn_type='softmax',
        img_size=224,
        patch_size=16,
        drop_path_rate=0.0),
    neck=None,
    head=dict(
        type='VisionTransformerClsHead',
        num_classes=1000,
        in_channels=384,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')))
