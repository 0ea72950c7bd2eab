"""A Softmax model trained by this project's own tools (an mmengine run checkpoint) can seed
the transfer: the demo pre-trains its teacher with tools/train.py."""
import numpy as np
import torch
from mmengine.logging import HistoryBuffer

from linvit_mm.models import LinearViT
from linvit_mm.transfer import load_softmax_checkpoint


def test_run_checkpoint_with_message_hub_is_read(tmp_path):
    vit = LinearViT(arch=dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64),
                    attn_type='softmax', img_size=32)
    state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state['head.layers.head.weight'] = torch.zeros(6, 32)
    state['head.layers.head.bias'] = torch.zeros(6)
    buffer = HistoryBuffer()
    buffer.update(np.float64(1.0))
    path = tmp_path / 'iter_600.pth'
    torch.save({'meta': {'iter': 600, 'seed': np.int64(0)}, 'state_dict': state,
                'message_hub': {'log_scalars': {'train/loss': buffer}},
                'optimizer': {'state': {}, 'param_groups': []}}, path)
    ckpt = load_softmax_checkpoint(str(path))
    assert ckpt.source_format == 'mmpretrain'
    assert ckpt.embed_dims == 32 and ckpt.depth == 2
    assert torch.equal(ckpt.state_dict['backbone.layers.1.attn.qkv.weight'],
                       vit.layers[1].attn.qkv.weight)
