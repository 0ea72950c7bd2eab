"""The Softmax ViT every transfer test reads: timm's DeiT-Tiny with distinct tensors."""
from collections import OrderedDict

import pytest
import timm
import torch


@pytest.fixture(scope='module')
def timm_deit():
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', pretrained=False).eval()
    # timm starts every norm at (1, 0) and every bias at 0, like our default init: identical
    # tensors would hide a swapped mapping or a copy that did not happen, so give every
    # tensor its own values.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture(scope='module')
def timm_sd(timm_deit):
    """Its state dict in timm's layout (detached copies)."""
    return OrderedDict((k, v.detach().clone()) for k, v in timm_deit.state_dict().items())
