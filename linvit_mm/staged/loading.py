"""``LinearViTCheckpoint``: load a LinearViT checkpoint strictly, operator by operator.

Usage in a config (``custom_imports`` with ``'linvit_mm.staged'`` registers it)::

    backbone=dict(type='LinearViT', arch='small', attn_type='relu',
                  init_cfg=dict(type='LinearViTCheckpoint',
                                checkpoint='work_dirs/..._align-attn_.../iter_N.pth'))

Every tensor of the ViT must be in the checkpoint with its shape, and nothing else may be under
the prefix; the checkpoint's record (see :mod:`linvit_mm.staged.record`) must name the model's
operator for every block, its head counts and sizes, and every tensor must be finite (the
check ``SoftmaxTransfer`` applies: a NaN or Inf weight is what a diverged run leaves). All
problems are reported before anything is copied, so a refused checkpoint leaves the model as
it was.
"""
from mmengine.logging import print_log
from mmengine.model.weight_init import update_init_info
from mmengine.registry import WEIGHT_INITIALIZERS

from linvit_mm.utils.checkpoint_state import state_problems

from .files import read_checkpoint
from .record import checkpoint_record, describe_linear_vit, record_differences

__all__ = ['LinearViTCheckpointInit', 'load_linear_vit_checkpoint']


def load_linear_vit_checkpoint(vit, filename, prefix='backbone.', require_record=True,
                               map_location='cpu', logger='current'):
    """Load the LinearViT ``vit`` strictly from the tensors under ``prefix`` in ``filename``.

    Args:
        vit (LinearViT): the model to load into.
        filename (str): a checkpoint file (mmengine run checkpoint or a state dict), read by
            linvit_mm's safe loader.
        prefix (str): the ViT's key prefix in the file: ``'backbone.'`` for the aligners and
            classifiers, ``''`` for a bare LinearViT state dict.
        require_record (bool): refuse a checkpoint without a record of its operators. With
            False such a checkpoint loads on names and shapes alone (a ``relu`` checkpoint
            then loads into an ``elu`` model); a record that is there is always checked.
        map_location (str): where tensors are loaded.
        logger: where the summary goes (``print_log``).

    Returns:
        dict: the record found (``None`` if there was none and it was not required).

    Raises:
        TypeError: ``vit`` is not a LinearViT.
        FileNotFoundError: no such file.
        ValueError: the checkpoint does not fit, every reason listed; a tensor holds NaN
            or Inf; the file cannot be read (truncated); nothing was loaded.
    """
    from linvit_mm.models.backbones import LinearViT
    if not isinstance(vit, LinearViT):
        raise TypeError(f'LinearViTCheckpoint loads into a LinearViT, got '
                        f'{type(vit).__name__}; give the init_cfg to the LinearViT itself')
    checkpoint = read_checkpoint(filename, map_location=map_location)
    state_dict = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else {}
    state = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not state:
        heads = sorted({k.split('.')[0] + '.' for k in state_dict})
        raise ValueError(f'{filename} has no tensors under {prefix!r}; its keys begin with '
                         f'{heads}: set prefix= to the ViT\'s prefix')

    model = describe_linear_vit(vit)
    problems = []
    record = checkpoint_record(checkpoint)
    described = (record or {}).get('backbones', {}).get(prefix)
    if described is None:
        if require_record:
            problems.append(
                f'it does not record the operator of each block of its ViT under {prefix!r} '
                f'(relu and elu blocks, or 3 and 6 heads of one width, have the same tensors), '
                f'so it cannot be checked against the model. Checkpoints of runs with '
                f'StagedRecordHook and of tools/model_converters/merge_aligned_blocks.py and '
                f'merge_lora.py carry the record; to load one without it on names and shapes '
                f'alone, set require_record=False')
    else:
        problems += record_differences(described, model)
    problems += state_problems(vit.state_dict(), state, prefix, vits={'': vit})
    if problems:
        raise ValueError(f'{filename} does not fit the model ({_summary(model)}), nothing was '
                         f'loaded:\n  - ' + '\n  - '.join(problems))
    from linvit_mm.transfer.formats import refuse_non_finite
    refuse_non_finite({prefix + key: value for key, value in state.items()}, {}, filename)

    vit.load_state_dict(state, strict=True)
    stage = (record or {}).get('stage')
    print_log(f'LinearViTCheckpoint: loaded {len(state)} tensors under {prefix!r} from '
              f'{filename}' + (f' (stage {stage!r})' if stage else '')
              + ('' if described else ' (no operator record; names and shapes checked only)'),
              logger=logger)
    return record


def _summary(description):
    operators = sorted(set(description['attn_types']))
    return (f'{"/".join(operators)}, {description["num_layers"]} blocks, width '
            f'{description["embed_dims"]}')


@WEIGHT_INITIALIZERS.register_module(name='LinearViTCheckpoint')
class LinearViTCheckpointInit:
    """Initialise a LinearViT from a LinearViT checkpoint, strictly (see
    :func:`load_linear_vit_checkpoint`, whose arguments these are).

    Like ``SoftmaxTransfer`` it runs the children's ``init_weights`` first, so that nothing
    mmengine runs after it overwrites what it loads; the file is read when the initialiser is
    called (``model.init_weights()``), not when it is built.
    """

    def __init__(self, checkpoint, prefix='backbone.', require_record=True, map_location='cpu'):
        if not isinstance(checkpoint, str) or not checkpoint:
            raise TypeError(f'LinearViTCheckpoint: checkpoint must be a file path, got '
                            f'{checkpoint!r}')
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str ('backbone.', or '' for a bare LinearViT "
                            f'state dict), got {prefix!r}')
        if not isinstance(require_record, bool):
            raise TypeError(f'require_record must be True or False, got {require_record!r}')
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.require_record = require_record
        self.map_location = map_location
        # mmengine's initialize() sets this on every initialiser; this one acts on the module
        # as a whole either way.
        self.wholemodule = False

    def __call__(self, module):
        from linvit_mm.transfer.initializer import init_children_first
        init_children_first(module)
        load_linear_vit_checkpoint(module, self.checkpoint, prefix=self.prefix,
                                   require_record=self.require_record,
                                   map_location=self.map_location)
        if hasattr(module, '_params_init_info'):
            update_init_info(module, init_info=f'{type(self).__name__}: {self.checkpoint} '
                                               f'(prefix {self.prefix!r})')
