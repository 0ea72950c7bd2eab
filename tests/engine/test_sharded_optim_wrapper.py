"""ShardedOptimWrapper: gradient-norm clipping over gradients sharded across processes."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mmengine.optim import OptimWrapper

from linvit_mm.engine import ShardedOptimWrapper
from linvit_mm.engine.sharded_optim_wrapper import sharded_clip_grad_norm_


def full_gradients():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in [(6, 5), (7, ), (3, 4)]]


def shard(tensor, rank, world):
    """What FSDP leaves on a rank: a disjoint flat piece of the parameter (maybe empty)."""
    flat = tensor.flatten()
    size = -(-flat.numel() // world)
    return flat[rank * size:(rank + 1) * size].clone()


def clip_on_rank(rank, world, port, results):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        params = []
        for grad in full_gradients():
            param = torch.nn.Parameter(torch.zeros(shard(grad, rank, world).shape))
            param.grad = shard(grad, rank, world)
            params.append(param)
        wrapper = ShardedOptimWrapper(torch.optim.SGD(params, lr=1.0),
                                      clip_grad=dict(max_norm=1.0))
        wrapper.step()
        results[rank] = [p.detach().clone() for p in params]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_clipping_of_shards_is_clipping_of_the_whole_model():
    """Two processes with half of each gradient take the same step as one with all of it."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(clip_on_rank, args=(2, port, results), nprocs=2, join=True)

    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in full_gradients()]
    for param, grad in zip(params, full_gradients()):
        param.grad = grad.clone()
    assert sum(g.square().sum() for g in full_gradients()).sqrt() > 1.0  # clipping acts
    OptimWrapper(torch.optim.SGD(params, lr=1.0), clip_grad=dict(max_norm=1.0)).step()
    for i, param in enumerate(params):
        pieces = torch.cat([results[rank][i] for rank in range(2)])
        torch.testing.assert_close(pieces, param.detach().flatten(), rtol=1e-6, atol=1e-7)


def test_one_process_and_value_clipping_are_the_plain_ones():
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3., 4., 0.])
    assert sharded_clip_grad_norm_([param], 1.0).item() == 5.0
    torch.testing.assert_close(param.grad, torch.tensor([.6, .8, 0.]), rtol=1e-5, atol=1e-6)
    wrapper = ShardedOptimWrapper(torch.optim.SGD([param], lr=1.0),
                                  clip_grad=dict(type='value', clip_value=0.1))
    assert wrapper.clip_func is torch.nn.utils.clip_grad_value_


@pytest.mark.parametrize('sharding', ['NO_SHARD', 'HYBRID_SHARD'])
def test_a_strategy_that_replicates_gradients_is_refused(sharding):
    """The norm over all ranks would count replicated gradients once per rank."""
    from linvit_mm.engine.fsdp_strategy import ParamGroupFSDPStrategy
    strategy = ParamGroupFSDPStrategy(model_wrapper=dict(sharding_strategy=sharding))
    with pytest.raises(ValueError, match=f"sharding_strategy='{sharding}' replicates"):
        strategy.check_clipping(dict(type='ShardedOptimWrapper', optimizer=dict(type='SGD')))
    strategy.check_clipping(dict(type='OptimWrapper', optimizer=dict(type='SGD')))
    ParamGroupFSDPStrategy(model_wrapper=dict(sharding_strategy='SHARD_GRAD_OP')).check_clipping(
        dict(type='ShardedOptimWrapper', optimizer=dict(type='SGD')))
