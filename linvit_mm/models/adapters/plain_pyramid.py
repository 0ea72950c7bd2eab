"""The plain-ViT baseline of ViT-Adapter: a LinearViT's tokens after four blocks, as a pyramid."""
import torch
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule, ModuleList
from mmpretrain.registry import MODELS
from torch import nn

from .linear_vit_adapter import LinearViTAdapter, _ceil_div
from .spatial_prior import kaiming_fan_out_


@MODELS.register_module()
class LinearViTPlainPyramid(BaseModule):
    """A :class:`LinearViT` and a simple feature pyramid (ViT-Adapter's ``ViTBaseline``).

    The ViT's patch tokens after blocks ``out_indices`` (default: the last of each quarter,
    ``(2, 5, 8, 11)`` for 12 blocks) are layer-normed, one LayerNorm per output, and turned
    into maps at strides 4, 8, 16 and 32 of a patch-16 ViT: a 4x up-sampling
    ``deconv 2x2 / 2 - GroupNorm(32) - GELU - deconv 2x2 / 2``, a 2x ``deconv 2x2 / 2``,
    the identity and a 2x2 max-pool. The class token and registers run through every block
    (the ViT sees the sequence it was trained on) and are dropped from the maps; ViT-Adapter's
    plain ViT drops the class token before the first block instead.

    Returns four ``(B, C, ceil(H / s), ceil(W / s))`` maps, ``s`` = 4, 8, 16, 32,
    ``C = vit.embed_dims`` (FPN / UperNet ``in_channels=[C] * 4``).

    **Why a backbone wrapper and not a neck.** In mmdet and mmseg the neck slot holds FPN
    (Mask R-CNN) or nothing (UperNet reads the backbone's levels), and both take a
    multi-level backbone; a wrapper that is that backbone keeps every Mask R-CNN / UperNet
    base config as it is, puts the pyramid beside the ViT it belongs to (one
    ``backbone.`` prefix for layer-wise lr decay and for the ImageNet-stage checkpoint,
    loaded exactly as :class:`LinearViTAdapter` loads it) and makes the plain and adapter
    configs differ in the backbone's ``type`` and its own arguments only.

    **Any input and patch size.** The patch embedding pads the image to whole patches at
    the bottom and right. With patch 16 the four levels are at strides 4 ... 32 and are
    cropped to ``ceil(H / s)`` (what a stride-``s`` conv backbone gives); the max-pool keeps
    a last odd row or column (``ceil_mode``), which on the even grids of mmdet / mmseg's
    32-padded batches is the plain max-pool. With another patch size ``p`` (14: DINOv2,
    EVA-02) the levels are at strides ``p / 4 ... 2 p``; each is resampled bilinearly to the
    stride-``s`` grid of ``ceil(H / s)`` cells, output cell centres taken to the input
    positions of the same image point (borders clamped), so that RoI pooling and the heads,
    which assume strides 4 ... 32, read the right places. The ViT itself runs at its own
    patch size on the image as given.

    Args:
        vit (dict): keyword arguments of :class:`LinearViT` (``type`` optional);
            ``final_norm`` must be left unset or False (the outputs have their own norms);
            ``out_indices`` and ``out_type`` are set here.
        out_indices (Sequence[int], optional): the four blocks whose tokens make the levels,
            strides 4, 8, 16, 32 in that order. Defaults to the last block of each quarter.
        norm_cfg (dict): the norm inside the 4x branch, ``dict(type='GN', num_groups=32)``
            as in ViT-Adapter.
        token_norm_cfg (dict): the per-output norm of the tokens, LN (eps 1e-6).
        with_cp (bool): gradient checkpointing of the ViT blocks.
        pretrained, checkpoint_prefix, init_cfg: the ImageNet-stage checkpoint, exactly as
            for :class:`LinearViTAdapter` (strict load of the ViT, its final norms skipped).
    """

    STRIDES = (4, 8, 16, 32)
    UNUSED_VIT_KEYS = LinearViTAdapter.UNUSED_VIT_KEYS

    def __init__(self,
                 vit,
                 out_indices=None,
                 norm_cfg=dict(type='GN', num_groups=32, requires_grad=True),
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
        if not isinstance(vit, dict):
            raise TypeError(f'vit must be a dict of LinearViT arguments, got {type(vit)}')
        given = sorted({'out_indices', 'out_type'} & set(vit))
        if given:
            raise ValueError(f'vit.{" / vit.".join(given)} are set by LinearViTPlainPyramid '
                             f'(out_indices is its own argument); leave them unset')
        num_layers = _vit_depth(vit)
        if out_indices is None:
            if num_layers % len(self.STRIDES):
                raise ValueError(f'a ViT of {num_layers} blocks has no four equal quarters; '
                                 f'give out_indices')
            quarter = num_layers // len(self.STRIDES)
            out_indices = [quarter * (i + 1) - 1 for i in range(len(self.STRIDES))]
        out_indices = [i % num_layers if -num_layers <= i < 0 else i for i in out_indices]
        if len(out_indices) != len(self.STRIDES) or sorted(set(out_indices)) != out_indices:
            raise ValueError(f'out_indices must be four increasing block indices (one level '
                             f'each), got {out_indices}')
        self.out_indices = tuple(out_indices)
        self.vit = LinearViTAdapter._build_vit(
            dict(vit, out_indices=list(out_indices), out_type='featmap'), with_cp)
        embed_dims = self.vit.embed_dims
        self.embed_dims = embed_dims
        self.token_norms = ModuleList(
            [build_norm_layer(token_norm_cfg, embed_dims)[1] for _ in self.STRIDES])
        self.up4 = nn.Sequential(
            nn.ConvTranspose2d(embed_dims, embed_dims, 2, stride=2),
            build_norm_layer(norm_cfg, embed_dims)[1],
            nn.GELU(),
            nn.ConvTranspose2d(embed_dims, embed_dims, 2, stride=2))
        self.up2 = nn.ConvTranspose2d(embed_dims, embed_dims, 2, stride=2)
        self.down2 = nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True)

    # the checkpoint and lr-decay interface of the adapter, which wraps the same ViT
    _pretrained_from_init_cfg = LinearViTAdapter.__dict__['_pretrained_from_init_cfg']
    load_vit_checkpoint = LinearViTAdapter.load_vit_checkpoint
    _check_vit_state = LinearViTAdapter._check_vit_state
    _resizable_pos_embed = LinearViTAdapter._resizable_pos_embed
    get_layer_depth = LinearViTAdapter.get_layer_depth

    def init_weights(self):
        """ViT-Adapter's init of the pyramid, the ViT's own, then ``pretrained`` ViT weights."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, nn.ConvTranspose2d):
                kaiming_fan_out_(module)
            elif isinstance(module, (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm2d)):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)
        if self.pretrained is not None:
            self.load_vit_checkpoint(self.pretrained, prefix=self.checkpoint_prefix)

    def forward(self, images):
        """``(B, 3, H, W)`` -> four ``(B, C, ceil(H/s), ceil(W/s))`` maps, s = 4, 8, 16, 32."""
        height, width = images.shape[-2:]
        maps = self.vit(images)
        maps = [norm(m.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()
                for norm, m in zip(self.token_norms, maps)]
        levels = [self.up4(maps[0]), self.up2(maps[1]), maps[2], self.down2(maps[3])]
        patch = self.vit.patch_size
        outs = []
        for level, stride, source in zip(levels, self.STRIDES, (patch / 4, patch / 2, patch,
                                                                 2 * patch)):
            size = (_ceil_div(height, stride), _ceil_div(width, stride))
            if source != stride:
                level = resample_to_stride(level, source, stride, size)
            outs.append(level[..., :size[0], :size[1]])
        return tuple(outs)


def _vit_depth(vit):
    """The depth of the LinearViT ``vit`` describes, before it is built."""
    from ..backbones import LinearViT
    return LinearViT.resolve_arch(vit.get('arch', 'small'))['num_layers']


def resample_to_stride(level, source_stride, stride, size):
    """A ``(B, C, h, w)`` map of cells ``source_stride`` px apart on the ``size`` grid of
    cells ``stride`` px apart, bilinear: output cell ``o``'s centre ``(o + 0.5) * stride`` px
    read at that image position of the input (cell ``i`` covers
    ``[i, i + 1) * source_stride``), positions past the input's border clamped to it."""
    h, w = level.shape[-2:]

    def axis(count, length):
        centres = (torch.arange(count, device=level.device, dtype=level.dtype) + .5) * stride
        return centres / (source_stride * length) * 2 - 1

    rows, cols = axis(size[0], h), axis(size[1], w)
    grid = torch.stack(torch.meshgrid(cols, rows, indexing='xy'), dim=-1)
    grid = grid.unsqueeze(0).expand(level.shape[0], -1, -1, -1)
    return F.grid_sample(level, grid, mode='bilinear', padding_mode='border',
                         align_corners=False)
