"""mmengine's FSDP strategy with the optimizer parameter groups of the unwrapped model."""
import copy

from mmengine._strategy import FSDPStrategy
from mmengine.config import ConfigDict
from mmengine.optim import build_optim_wrapper
from mmengine.registry import STRATEGIES

from .sharded_optim_wrapper import ShardedOptimWrapper


@STRATEGIES.register_module()
class ParamGroupFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` whose optimizer groups are built on the model before FSDP wraps it.

    mmengine's ``FSDPStrategy`` builds an optimizer config on the wrapped model, whose
    parameters (``use_orig_params=True``) are each rank's 1-D shards of the originals. The
    optimizer constructor's rules by shape then misfire: with ``flat_decay_mult=0`` (the
    ImageNet recipe, for LayerScale and the like) every weight matrix looks flat and loses
    its weight decay, silently. Here the optimizer wrapper is built from the config on the
    unwrapped model (the same groups as under DDP), and once FSDP has wrapped it each
    parameter of those groups is replaced, by name, by its sharded one. Everything else is
    ``FSDPStrategy``'s (arguments included).
    """

    # Strategies under which every gradient element lives on exactly one rank, which
    # ShardedOptimWrapper's norm over all ranks assumes (NO_SHARD and the hybrid ones
    # replicate gradients, and the sum would count them several times).
    DISJOINT_SHARDING = ('FULL_SHARD', 'SHARD_GRAD_OP')

    def prepare(self, model, *, optim_wrapper=None, **kwargs):
        self.check_clipping(optim_wrapper)
        self._optim_wrapper_cfg = optim_wrapper
        return super().prepare(model, optim_wrapper=optim_wrapper, **kwargs)

    def check_clipping(self, optim_wrapper):
        """Refuse ``ShardedOptimWrapper`` with a sharding strategy that replicates gradients."""
        if not (isinstance(optim_wrapper, (dict, ConfigDict))
                and optim_wrapper.get('type') in ('ShardedOptimWrapper', ShardedOptimWrapper)):
            return
        sharding = (self.model_wrapper or {}).get('sharding_strategy', 'FULL_SHARD')
        name = getattr(sharding, 'name', sharding)
        if name not in self.DISJOINT_SHARDING:
            raise ValueError(
                f'ShardedOptimWrapper clips by the norm over all ranks\' gradient shards, which '
                f'needs each gradient element on one rank (sharding_strategy '
                f'{" or ".join(self.DISJOINT_SHARDING)}); sharding_strategy={name!r} replicates '
                f'them. Use optim_wrapper=dict(type=\'OptimWrapper\') with it.')

    def _wrap_model(self, model):
        cfg = getattr(self, '_optim_wrapper_cfg', None)
        self._unwrapped_optim_wrapper = None
        if isinstance(cfg, (dict, ConfigDict)) and ('optimizer' in cfg or 'constructor' in cfg):
            self._unwrapped_optim_wrapper = build_optim_wrapper(model, copy.deepcopy(cfg))
        return super()._wrap_model(model)

    def build_optim_wrapper(self, optim_wrapper, model=None):
        built = getattr(self, '_unwrapped_optim_wrapper', None)
        if built is None or optim_wrapper is not self._optim_wrapper_cfg:
            return super().build_optim_wrapper(optim_wrapper, model)
        self._unwrapped_optim_wrapper = None
        # An optimizer without state holds its parameters in its groups only, so the
        # sharded ones can take their places. (FSDPStrategy's own path for a built wrapper
        # re-creates the optimizer from its defaults, which torch's AdamW no longer takes.)
        if built.optimizer.state:
            raise RuntimeError('the optimizer built before wrapping already has state')
        sharded = {name.replace('_fsdp_wrapped_module.', ''): param
                   for name, param in model.named_parameters()}
        for group in built.optimizer.param_groups:
            group['params'] = [sharded[self.id_to_name[id(param)]] for param in group['params']]
        return built
