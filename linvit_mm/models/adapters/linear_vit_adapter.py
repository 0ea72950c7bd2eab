"""ViT-Adapter around a LinearViT of any operator: four feature maps for FPN / UperNet."""
import re

import torch
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule, ModuleList
from mmengine.registry import DefaultScope
from mmpretrain.registry import MODELS
from torch import nn

from ...utils.checkpoint_state import resizable_pos_embed
from ..backbones import LinearViT
from .interaction_block import InteractionBlock
from .multi_scale import deformable_inputs, flatten_maps, split_maps
from .spatial_prior import SpatialPriorModule, kaiming_fan_out_
from .vit_weights import check_vit_state, load_vit_weights


def _ceil_div(a, b):
    return -(-a // b)


@MODELS.register_module()
class LinearViTAdapter(BaseModule):
    """ViT-Adapter (Chen et al., ICLR 2023) wrapping a :class:`LinearViT`.

    A spatial prior module (conv stem) gives features at strides 4/8/16/32; before
    each group of ViT blocks an injector adds the stride 8/16/32 features to the
    ViT tokens by multi-scale deformable attention (zero-initialised layer scale, so
    training starts from the plain pre-trained ViT), and after it an extractor
    updates those features from the ViT tokens (deformable attention + ConvFFN).
    The stride-4 map is the spatial prior's plus a 2x transposed-conv upsampling of
    the final stride-8 map. With ``add_vit_feature`` the ViT patch tokens, resized
    bilinearly, are added to every level. Each level then goes through its own norm.

    Returns a tuple of four ``(B, C, h_s, w_s)`` maps at strides 4, 8, 16, 32 with
    ``C = vit.embed_dims`` (FPN / UperNet ``in_channels=[C] * 4``).

    **Input size.** Any ``H x W`` is accepted. The image is zero-padded at the
    bottom and right to multiples of ``size_divisor`` = 32, so that every level of
    the spatial prior tiles the same area exactly; each output is then cropped to
    ``ceil(H / s) x ceil(W / s)`` of the *original* size, which is what a stride-``s``
    conv backbone with padding gives, so heads that compute feature sizes from the
    image size agree with it. mmdet and mmseg pad batches to a multiple of 32
    themselves, so usually nothing is padded here.

    **Patch size.** The ViT runs at its own stride on the same padded image, its
    patch embedding padding it to whole patches: a patch-16 ViT tiles exactly the
    area of the levels, a patch-14 one (DINOv2, EVA-02) a little more, ``ceil(H' / 14)``
    cells a side. Where the two meet, positions are matched in pixels: the
    deformable attention's reference points are the cell centres as fractions of the
    area the sampled maps tile (``deformable_inputs``' extents), and with
    ``add_vit_feature`` the ViT map is resampled by ``patch_size / s`` (bilinear, on
    pixel centres) and cropped to the level. The pre-trained ViT thus sees the image
    at its own scale and patch size (ViT-Adapter's DINOv2 models resize the patch
    embedding to 16 instead, other DINOv2 adapters shrink the image by 14 / 16: both
    change what the copied weights compute), at the cost of (16 / 14)^2 = 1.31x the
    tokens of patch 16, which the linear operators take in linear time.

    **Registers and RoPE.** The leading non-patch tokens (class token and
    registers, ``vit.num_extra_tokens``) run through every ViT block and skip the
    injectors and extractors; the blocks get the ViT grid, from which RoPE builds its
    rotations.

    **ViT final norm.** ViT-Adapter does not use the ViT's final norm (its outputs
    have their own norms), and an unused parameter would stall DDP; the ViT is
    therefore built with ``final_norm=False`` (and ``pooled_norm=False``) and a
    checkpoint's ``ln1.*`` (and ``ln2.*``, mmpretrain's pooled-feature norm) is skipped
    and reported.

    **Class token.** When the ViT carries one it skips the injector and extractors
    (they work on the patch grid) and is re-attached before every group of ViT
    blocks, so the ViT sees the sequence it was trained on.

    Args:
        vit (dict): keyword arguments of :class:`LinearViT` (``type`` optional);
            ``final_norm`` must be left unset or False.
        interaction_indexes (list[list[int]], optional): first and last ViT block
            of each interaction; contiguous groups covering every block. Defaults to
            four equal groups (``[[0, 2], [3, 5], [6, 8], [9, 11]]`` for 12 blocks).
        conv_inplane (int): width of the spatial prior module at stride 4.
        n_points (int): sampling points per head and level. Defaults to 4.
        deform_num_heads (int, optional): deformable-attention heads; defaults to
            6 / 6 / 12 for widths 192 / 384 / 768 (ViT-Adapter T / S / B).
        deform_ratio (float, optional): value width ratio of the deformable
            attention; defaults to 1.0 / 1.0 / 0.5 for widths 192 / 384 / 768.
        init_values (float): initial injector layer scale. Defaults to 0.
        with_cffn (bool): ConvFFN in the extractors. ``cffn_ratio`` (0.25) sets
            its hidden width.
        drop_path_rate (float, optional): drop-path of the extractors' ConvFFN;
            defaults to the ViT's ``drop_path_rate``, as in ViT-Adapter.
        use_extra_extractor (bool): two more extractors in the last interaction.
        add_vit_feature (bool): add the ViT patch tokens to every output level.
        vit_feature_mode (str): ``'last'``: the final ViT tokens are added to all
            four levels (ViT-Adapter's detection code); ``'per_interaction'``: the
            tokens after interaction ``i`` are added to level ``i`` (its
            segmentation code; needs four interactions).
        norm_cfg (dict): norm of the spatial prior module and of the four
            outputs. Defaults to BN; give SyncBN in multi-GPU configs.
        token_norm_cfg (dict): norm of injector and extractor tokens.
        with_cp (bool): gradient checkpointing of the injectors, extractors and
            ViT blocks.
        pretrained (str, optional): checkpoint whose ViT weights are loaded by
            :meth:`init_weights` (see :meth:`load_vit_checkpoint`).
        checkpoint_prefix (str): prefix of the ViT keys in that checkpoint;
            ``'backbone.'`` for an mmpretrain ``ImageClassifier`` checkpoint, ``''``
            for a bare LinearViT state dict.
        init_cfg (dict, optional): only ``dict(type='Pretrained', checkpoint=...,
            prefix=...)`` is accepted, as another spelling of ``pretrained`` /
            ``checkpoint_prefix``: mmengine's own ``Pretrained`` initialiser would
            load non-strictly into the wrapper, whose ViT keys sit under ``vit.``.
    """

    # ViT-Adapter-T/S/B by ViT width: (deformable heads, deform ratio).
    DEFORM_DEFAULTS = {192: (6, 1.0), 384: (6, 1.0), 768: (12, 0.5)}
    VIT_FEATURE_MODES = ('last', 'per_interaction')
    STRIDES = (4, 8, 16, 32)
    # Top-level ViT norms that dense prediction does not use (final norm over all
    # tokens, mmpretrain's norm after average pooling): skipped when loading.
    UNUSED_VIT_KEYS = re.compile(r'^(ln1|ln2)\.')

    def __init__(self,
                 vit,
                 interaction_indexes=None,
                 conv_inplane=64,
                 n_points=4,
                 deform_num_heads=None,
                 deform_ratio=None,
                 init_values=0.,
                 with_cffn=True,
                 cffn_ratio=0.25,
                 drop_path_rate=None,
                 use_extra_extractor=True,
                 add_vit_feature=True,
                 vit_feature_mode='last',
                 norm_cfg=dict(type='BN', requires_grad=True),
                 token_norm_cfg=dict(type='LN', eps=1e-6),
                 with_cp=False,
                 pretrained=None,
                 checkpoint_prefix='backbone.',
                 init_cfg=None):
        pretrained, checkpoint_prefix = self._pretrained_from_init_cfg(
            init_cfg, pretrained, checkpoint_prefix)
        super().__init__(init_cfg=None)
        self.pretrained = pretrained
        self.checkpoint_prefix = checkpoint_prefix

        self.vit = self._build_vit(vit, with_cp)
        embed_dims = self.vit.embed_dims
        self.embed_dims = embed_dims
        # The spatial prior's levels tile a multiple of the largest stride exactly; the
        # ViT's grid is matched to them in pixels (see the class docstring).
        self.size_divisor = self.STRIDES[-1]

        self.interaction_indexes = self._check_interaction_indexes(interaction_indexes)
        if vit_feature_mode not in self.VIT_FEATURE_MODES:
            raise ValueError(f'unsupported vit_feature_mode {vit_feature_mode!r}; choose from '
                             f'{self.VIT_FEATURE_MODES}')
        if (add_vit_feature and vit_feature_mode == 'per_interaction'
                and len(self.interaction_indexes) != len(self.STRIDES)):
            raise ValueError(f'vit_feature_mode="per_interaction" adds the output of interaction '
                             f'i to level i, so it needs {len(self.STRIDES)} interactions, got '
                             f'{len(self.interaction_indexes)}')
        self.add_vit_feature = add_vit_feature
        self.vit_feature_mode = vit_feature_mode
        deform_num_heads, deform_ratio = self._deform_settings(deform_num_heads, deform_ratio)
        self.deform_num_heads = deform_num_heads
        self.deform_ratio = deform_ratio
        if drop_path_rate is None:
            drop_path_rate = float(vit.get('drop_path_rate', 0.))

        self.spm = SpatialPriorModule(inplanes=conv_inplane, embed_dims=embed_dims,
                                      in_channels=vit.get('in_channels', 3), norm_cfg=norm_cfg)
        self.level_embed = nn.Parameter(torch.zeros(len(self.STRIDES) - 1, embed_dims))
        num_interactions = len(self.interaction_indexes)
        self.interactions = ModuleList([
            InteractionBlock(
                embed_dims, num_heads=deform_num_heads, num_points=n_points,
                num_levels=len(self.STRIDES) - 1, deform_ratio=deform_ratio,
                init_values=init_values, with_cffn=with_cffn, cffn_ratio=cffn_ratio,
                drop_path_rate=drop_path_rate, norm_cfg=token_norm_cfg,
                num_extra_extractors=2 if use_extra_extractor and i == num_interactions - 1 else 0,
                with_cp=with_cp) for i in range(num_interactions)
        ])
        self.up = nn.ConvTranspose2d(embed_dims, embed_dims, 2, stride=2)
        self.out_norms = ModuleList(
            [build_norm_layer(norm_cfg, embed_dims)[1] for _ in self.STRIDES])

    # ------------------------------------------------------------------ construction
    @classmethod
    def _pretrained_from_init_cfg(cls, init_cfg, pretrained, checkpoint_prefix):
        if init_cfg is None:
            return pretrained, checkpoint_prefix
        if not (isinstance(init_cfg, dict) and init_cfg.get('type') == 'Pretrained'
                and 'checkpoint' in init_cfg):
            raise ValueError(f"{cls.__name__} accepts only init_cfg=dict(type='Pretrained', "
                             f"checkpoint=PATH[, prefix='backbone.']) (or pretrained=PATH); its "
                             f"own parts have a fixed initialisation. Got {init_cfg!r}")
        if pretrained is not None:
            raise ValueError('give the checkpoint either as pretrained= or as init_cfg, not both')
        return init_cfg['checkpoint'], init_cfg.get('prefix', checkpoint_prefix)

    @staticmethod
    def _build_vit(vit, with_cp):
        if not isinstance(vit, dict):
            raise TypeError(f'vit must be a dict of LinearViT arguments, got {type(vit)}')
        cfg = dict(vit)
        if cfg.get('final_norm', False):
            raise ValueError('vit.final_norm must be False (or unset): ViT-Adapter does not use '
                             "the ViT's final norm, and an unused parameter breaks DDP; a "
                             "checkpoint's final norm (ln1.*) is skipped when loading")
        cfg['final_norm'] = False
        # nor the norm of pooled features (EVA-02's fc_norm), for the same reason
        cfg['pooled_norm'] = False
        if with_cp:
            cfg['with_cp'] = True
        cfg.setdefault('type', 'LinearViT')
        # Built in mmpretrain's scope, where LinearViT is registered, whatever the
        # run's default scope is (mmdet, mmseg).
        with DefaultScope.overwrite_default_scope('mmpretrain'):
            model = MODELS.build(cfg)
        if not isinstance(model, LinearViT):
            raise TypeError(f'vit must build a LinearViT (its block runner embed/layers is what '
                            f'the adapter drives), got {type(model).__name__}')
        # The ViT grid is matched to the levels as tiling grid * patch_size pixels from the
        # top-left corner: only bottom-right padding to whole patches keeps that true.
        padding = getattr(model.patch_embed, 'adaptive_padding', None)
        if getattr(padding, 'padding', None) != 'corner':
            raise ValueError(f"vit.patch_cfg must keep the patch embedding's padding='corner' "
                             f'(pad bottom and right to whole patches), got '
                             f"{cfg.get('patch_cfg', {}).get('padding')!r}")
        return model

    def _check_interaction_indexes(self, indexes):
        num_layers = self.vit.num_layers
        if indexes is None:
            groups = len(self.STRIDES)
            if num_layers % groups:
                raise ValueError(f'a ViT of {num_layers} blocks cannot be split into {groups} '
                                 f'equal interaction groups; give interaction_indexes')
            size = num_layers // groups
            return [[i * size, (i + 1) * size - 1] for i in range(groups)]
        indexes = [list(group) for group in indexes]
        expected_start = 0
        for group in indexes:
            if len(group) != 2 or group[0] != expected_start or group[1] < group[0]:
                raise ValueError(
                    f'interaction_indexes must be [first, last] block pairs that follow one '
                    f'another from block 0, got {indexes}')
            expected_start = group[1] + 1
        if expected_start != num_layers:
            raise ValueError(f'interaction_indexes {indexes} must cover all {num_layers} ViT '
                             f'blocks (a block left out would be an unused parameter)')
        return indexes

    def _deform_settings(self, num_heads, ratio):
        if num_heads is None or ratio is None:
            if self.embed_dims not in self.DEFORM_DEFAULTS:
                raise ValueError(f'no ViT-Adapter default for embed_dims={self.embed_dims} '
                                 f'(known: {sorted(self.DEFORM_DEFAULTS)}); give '
                                 f'deform_num_heads and deform_ratio')
            default_heads, default_ratio = self.DEFORM_DEFAULTS[self.embed_dims]
            num_heads = default_heads if num_heads is None else num_heads
            ratio = default_ratio if ratio is None else ratio
        value_dims = int(self.embed_dims * ratio)
        if self.embed_dims % num_heads or value_dims % num_heads:
            raise ValueError(f'deform_num_heads={num_heads} must divide embed_dims='
                             f'{self.embed_dims} and the value width embed_dims * deform_ratio '
                             f'= {value_dims}')
        return num_heads, ratio

    # ------------------------------------------------------------------ weights
    def init_weights(self):
        """ViT-Adapter's init of the adapter, the ViT's own, then ``pretrained`` ViT weights."""
        super().init_weights()  # the ViT, spatial prior module and interaction blocks
        kaiming_fan_out_(self.up)
        for norm in self.out_norms:
            if getattr(norm, 'weight', None) is not None:
                nn.init.ones_(norm.weight)
                nn.init.zeros_(norm.bias)
        nn.init.normal_(self.level_embed)
        if self.pretrained is not None:
            self.load_vit_checkpoint(self.pretrained, prefix=self.checkpoint_prefix)

    def load_vit_checkpoint(self, filename, prefix='backbone.'):
        """Load the ViT strictly from a checkpoint of the classification stage.

        The file is read through mmengine's ``CheckpointLoader``, which
        ``linvit_mm`` routes through its safe loader (weight files and mmengine run
        checkpoints load; a pickle carrying code is refused). Keys
        under ``prefix`` must match the ViT exactly: a missing, unexpected or
        mis-shaped one is a ``ValueError`` naming it. A learned ``pos_embed`` of
        another square grid is resized by LinearViT's load hook. Skipped and
        reported: the ViT's final norms and every key outside ``prefix`` (the head,
        the data preprocessor). The adapter's own keys, initialised by
        :meth:`init_weights`, are logged.
        """
        load_vit_weights(self, filename, prefix)

    def _check_vit_state(self, vit_state, prefix, filename):
        check_vit_state(self, vit_state, prefix, filename)

    def _resizable_pos_embed(self, pos_embed):
        """Whether LinearViT's load hook can resize it: a square grid of the same width."""
        return resizable_pos_embed(self.vit, pos_embed)

    def get_layer_depth(self, param_name, prefix=''):
        """Depth for layer-wise lr decay: the ViT's depths for ViT parameters, the
        last depth for the adapter (as BEiT / ViT-Adapter's decay puts every
        non-ViT parameter). Returns ``(depth, num_layers + 2)``."""
        vit_prefix = prefix + 'vit.'
        if param_name.startswith(vit_prefix):
            return self.vit.get_layer_depth(param_name, vit_prefix)
        num_depths = self.vit.num_layers + 2
        return num_depths - 1, num_depths

    # ------------------------------------------------------------------ forward
    def forward(self, images):
        """``(B, 3, H, W)`` -> four ``(B, C, ceil(H/s), ceil(W/s))`` maps, s = 4, 8, 16, 32."""
        height, width = images.shape[-2:]
        pad_h, pad_w = (-height) % self.size_divisor, (-width) % self.size_divisor
        if pad_h or pad_w:
            images = F.pad(images, (0, pad_w, 0, pad_h))

        c1, c2, c3, c4 = self.spm(images)
        levels = [c2, c3, c4]
        level_shapes = [tuple(level.shape[-2:]) for level in levels]
        c = flatten_maps([level + embed[:, None, None]
                          for level, embed in zip(levels, self.level_embed)])

        # The patch embedding pads the image to whole patches (bottom and right), so the
        # ViT grid tiles grid * patch_size pixels, at least the levels' area.
        tokens, vit_shape = self.vit.embed(images)
        prior_extent = tuple(images.shape[-2:])
        vit_extent = (vit_shape[0] * self.vit.patch_size, vit_shape[1] * self.vit.patch_size)
        num_extra = self.vit.num_extra_tokens
        cls_tokens = tokens[:, :num_extra] if num_extra else None
        x = tokens[:, num_extra:]
        inject_inputs = deformable_inputs([vit_shape], level_shapes, like=x,
                                          query_extent=vit_extent, value_extent=prior_extent)
        extract_inputs = deformable_inputs(level_shapes, [vit_shape], like=x,
                                           query_extent=prior_extent, value_extent=vit_extent)

        vit_outputs = []
        for interaction, (first, last) in zip(self.interactions, self.interaction_indexes):
            x, c, cls_tokens = interaction(x, c, cls_tokens, self.vit.layers[first:last + 1],
                                           vit_shape, level_shapes, inject_inputs,
                                           extract_inputs)
            vit_outputs.append(x)

        c2, c3, c4 = split_maps(c, level_shapes)
        outs = [self.up(c2) + c1, c2, c3, c4]
        if self.add_vit_feature:
            if self.vit_feature_mode == 'last':
                vit_outputs = [x] * len(outs)
            for i, (vit_tokens, stride) in enumerate(zip(vit_outputs, self.STRIDES)):
                vit_map = split_maps(vit_tokens, [vit_shape])[0]
                outs[i] = outs[i] + self.resample_vit_map(vit_map, stride, outs[i].shape[-2:])
        # Crop before the norms so that batch statistics see no padding.
        return tuple(
            norm(out[..., :_ceil_div(height, stride), :_ceil_div(width, stride)])
            for norm, out, stride in zip(self.out_norms, outs, self.STRIDES))

    def resample_vit_map(self, vit_map, stride, level_shape):
        """The ViT's ``(B, C, h, w)`` map on the grid of stride ``stride``, ``level_shape``.

        Bilinear with the scale ``patch_size / stride`` itself (not the ratio of the two
        sizes, which differ from it when the ViT tiles more than the level): output
        pixel centres map to the input pixel centres at the same image position. The
        result, at least ``level_shape``, is cropped to it at the bottom and right.
        """
        scale = self.vit.patch_size / stride
        if scale != 1:
            vit_map = F.interpolate(vit_map, scale_factor=scale, mode='bilinear',
                                    align_corners=False, recompute_scale_factor=False)
        return vit_map[..., :level_shape[0], :level_shape[1]]
