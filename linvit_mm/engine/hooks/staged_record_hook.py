"""Record in every checkpoint which LinearViT wrote it (operators, heads, sizes, stage)."""
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

from linvit_mm.staged import RECORD_KEY, find_linear_vits, model_record


@HOOKS.register_module()
class StagedRecordHook(Hook):
    """Writes the model's record into ``checkpoint['meta']['linvit_mm']`` at every save.

    The record (:mod:`linvit_mm.staged.record`) describes each LinearViT of the model by its
    key prefix: the operator and head count of every block, width, depth, patch size and
    extra tokens, which the tensors alone do not tell apart (``relu`` and ``elu`` blocks have
    the same tensors); for the aligners also the stage and, for attention alignment, the
    blocks the run trained. ``LinearViTCheckpoint`` checks it when the next stage loads the
    checkpoint, and ``merge_aligned_blocks.py`` reads the trained blocks from it.

    A model without a LinearViT is refused before the run starts.
    """

    priority = 'NORMAL'

    @staticmethod
    def _model(runner):
        return runner.model.module if is_model_wrapper(runner.model) else runner.model

    def before_run(self, runner):
        if not find_linear_vits(self._model(runner)):
            raise ValueError(f'StagedRecordHook: the model ({type(self._model(runner)).__name__}) '
                             f'holds no LinearViT to record')

    def before_save_checkpoint(self, runner, checkpoint):
        checkpoint.setdefault('meta', {})[RECORD_KEY] = model_record(self._model(runner))
