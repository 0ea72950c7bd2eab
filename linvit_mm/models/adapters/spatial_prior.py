"""Spatial prior module of ViT-Adapter: a small conv stem giving features at strides 4 to 32."""
import math

from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule
from torch import nn


def kaiming_fan_out_(conv):
    """``N(0, 2 / fan_out)`` weights and zero bias (ViT-Adapter's init of its convs)."""
    fan_out = conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels // conv.groups
    nn.init.normal_(conv.weight, 0., math.sqrt(2. / fan_out))
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _conv_norm_relu(in_channels, out_channels, stride, norm_cfg):
    return [
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        build_norm_layer(norm_cfg, out_channels)[1],
        nn.ReLU(inplace=True),
    ]


class SpatialPriorModule(BaseModule):
    """Conv stem -> maps at strides 4, 8, 16, 32, each projected to ``embed_dims``.

    ViT-Adapter (Chen et al., ICLR 2023): a ResNet-style stem (three 3x3 convs, the
    first with stride 2, then a stride-2 max-pool) gives stride 4 with ``inplanes``
    channels; three stride-2 3x3 convs give strides 8, 16 and 32 with 2, 4 and 4 times
    ``inplanes`` channels; 1x1 convs project every level to ``embed_dims``.

    With an input whose sides are multiples of 32 the maps are exactly
    ``H/s x W/s``; every conv and the pool use padding 1, so other sizes give
    ``ceil`` sizes.

    Args:
        inplanes (int): channels at stride 4. Defaults to 64.
        embed_dims (int): channels of the projected outputs (the ViT width).
        in_channels (int): image channels. Defaults to 3.
        norm_cfg (dict): norm after each conv (BN, SyncBN, GN, ...).
    """

    def __init__(self, inplanes=64, embed_dims=384, in_channels=3,
                 norm_cfg=dict(type='BN', requires_grad=True), init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.stem = nn.Sequential(
            *_conv_norm_relu(in_channels, inplanes, 2, norm_cfg),
            *_conv_norm_relu(inplanes, inplanes, 1, norm_cfg),
            *_conv_norm_relu(inplanes, inplanes, 1, norm_cfg),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self.conv2 = nn.Sequential(*_conv_norm_relu(inplanes, 2 * inplanes, 2, norm_cfg))
        self.conv3 = nn.Sequential(*_conv_norm_relu(2 * inplanes, 4 * inplanes, 2, norm_cfg))
        self.conv4 = nn.Sequential(*_conv_norm_relu(4 * inplanes, 4 * inplanes, 2, norm_cfg))
        self.fc1 = nn.Conv2d(inplanes, embed_dims, 1)
        self.fc2 = nn.Conv2d(2 * inplanes, embed_dims, 1)
        self.fc3 = nn.Conv2d(4 * inplanes, embed_dims, 1)
        self.fc4 = nn.Conv2d(4 * inplanes, embed_dims, 1)

    def init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                kaiming_fan_out_(module)
            elif isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm)):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)
        self._is_init = True

    def forward(self, x):
        """``(B, 3, H, W)`` -> four ``(B, embed_dims, h_s, w_s)`` maps, strides 4, 8, 16, 32."""
        c1 = self.stem(x)
        c2 = self.conv2(c1)
        c3 = self.conv3(c2)
        c4 = self.conv4(c3)
        return self.fc1(c1), self.fc2(c2), self.fc3(c3), self.fc4(c4)
