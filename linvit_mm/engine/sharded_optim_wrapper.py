"""The optimizer wrapper of FSDP runs: gradient-norm clipping over the whole sharded model."""
import torch
import torch.distributed as dist
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register_module()
class ShardedOptimWrapper(OptimWrapper):
    """``OptimWrapper`` for parameters that FSDP shards (``FULL_SHARD`` or ``SHARD_GRAD_OP``,
    ``use_orig_params=True``: mmengine's ``FSDPStrategy`` with ``FlexibleRunner``).

    Each rank then holds a disjoint shard of every gradient, so mmengine's norm clipping
    (``torch.nn.utils.clip_grad_norm_`` over the local gradients) would scale each shard by
    its own norm: another direction on every rank, and a smaller norm than the model's. Here
    the ``p``-th powers of the local norms are summed over the ranks first, which is the
    total norm ``FullyShardedDataParallel.clip_grad_norm_`` computes (that method needs the
    root FSDP module, which an optimizer wrapper does not hold), and every shard is scaled
    by the same factor. ``clip_grad=dict(type='value', ...)`` is elementwise and unchanged.
    Without a process group (one process) it is the plain clipping. The logged
    ``grad_norm`` is the total norm.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.clip_grad_kwargs and self.clip_func is torch.nn.utils.clip_grad_norm_:
            self.clip_func = sharded_clip_grad_norm_


def sharded_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                            foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` for gradients sharded over the default process
    group (each element held by one rank); returns the total norm."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
    params = [p for p in parameters if p.grad is not None and p.grad.numel()]
    grads = [p.grad for p in params]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device('cpu')
    local = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach) \
        if grads else torch.zeros((), device=device)
    local = local.to(device=device, dtype=torch.float32)
    if norm_type == float('inf'):
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        total = local
    else:
        local = local.pow(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        total = local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f'the total norm of order {norm_type} of the sharded gradients is '
                           f'non-finite, so it cannot be clipped')
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
