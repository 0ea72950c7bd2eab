# The demo's ViT (linvit-mini.py: width 96, 4 blocks, patch 8) inside the ViT-Adapter, one
# interaction per block; BN (the demo runs on one CPU process). The ViT weights come from
# a demo classification run (tools/demo.py passes the best one with --cfg-options
# model.backbone.pretrained=PATH).
mini_adapter = dict(
    pretrained='work_dirs/linvit-relu-mini_mlpcopy-distill_1xb24_mini-groups/iter_200.pth',
    vit=dict(
        arch=dict(
            _delete_=True, embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384),
        attn_type='relu',
        img_size=64,
        patch_size=8,
        drop_path_rate=0.0),
    interaction_indexes=[[0, 0], [1, 1], [2, 2], [3, 3]],
    deform_num_heads=3,
    deform_ratio=1.0,
    conv_inplane=16,
    norm_cfg=dict(type='BN', requires_grad=True))
