# The demo's ViT (linvit-mini.py: width 96, 4 blocks, patch 8) as ViT-Adapter's plain-ViT
# baseline: the tokens after every block (the last of each quarter of four), a LayerNorm each,
# the deconv / identity / max-pool pyramid. The ViT weights come from a demo classification run
# (tools/demo.py passes its classifier with --cfg-options model.backbone.pretrained=PATH, or
# pretrained=None for the randomly initialised control).
mini_plain = dict(
    _delete_=True,
    type='mmpretrain.LinearViTPlainPyramid',
    pretrained='work_dirs/linvit-relu-mini_mlpcopy-distill_1xb24_mini-groups/iter_200.pth',
    vit=dict(
        arch=dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384),
        attn_type='relu',
        img_size=64,
        patch_size=8,
        drop_path_rate=0.0),
    norm_cfg=dict(type='GN', num_groups=32, requires_grad=True),
    checkpoint_prefix='backbone.')
