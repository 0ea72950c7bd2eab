# The authors' MHLA ViT-S (DAGroup-PKU/MHLA: deit_small_pla_1d_v6_6 with their ImageNet
# script's piece_size=4 transform=linear) as a LinearViT classifier: no class token,
# learned position embedding of the 16 x 16 grid of 256 px, no qkv bias, average pooling
# then a norm (timm's fc_norm; no final norm), and in every block the mhla operator with
# the authors' switches (linvit_mm.models.attention.mhla.OFFICIAL_IMAGENET;
# docs/user_guides/operators.md).
# Their ViT zero-pads 224 px inputs (after normalisation) by 16 px on every side to 256 px;
# give this model 256 px inputs prepared that way to compute what theirs does.
_base_ = ['./linvit-classifier.py']

mhla_official_attn_cfg = dict(
    num_blocks=(4, 4), mixing_init='linear', normaliser='official', attn_norm=True,
    qk_norm=True)

model = dict(
    backbone=dict(
        arch=dict(
            _delete_=True, embed_dims=384, num_layers=12, num_heads=6, feedforward_channels=1536,
            qkv_bias=False, pos_embed_type='learned', final_norm=False, pooled_norm=True),
        attn_type='mhla',
        attn_cfg=mhla_official_attn_cfg,
        img_size=256,
        out_type='avg_featmap',
        drop_path_rate=0.1),
    head=dict(in_channels=384))
