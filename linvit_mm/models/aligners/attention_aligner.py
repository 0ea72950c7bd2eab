"""Stage 1 of the staged recipe: attention alignment, block by block, on the teacher's inputs."""
import torch
import torch.nn.functional as F
from mmpretrain.registry import MODELS
from torch.utils.checkpoint import checkpoint

from .. import pairing
from .base_aligner import BaseAligner


@MODELS.register_module()
class AttentionAligner(BaseAligner):
    """Trains each block's linear attention to reproduce the Softmax attention on the same input.

    ``loss_align = loss_weight * sum_blocks MSE(student attention output, teacher attention
    output)`` (ViT-AdaLA's attention alignment; LoLCATs' attention transfer). Each student
    block works on the **teacher's own input to that block**: the teacher runs under
    ``no_grad`` and its block input ``x`` (detached) goes through the student block's
    ``attn.encode_position`` (TTT's conditional position encoding; identity for the other
    operators) and ``ln1``, then its attention. ``ln1`` is the teacher's, copied and frozen, so
    every operator without a position encoding sees exactly the teacher's normalised input;
    TTT sees it after its own (trained) encoding. No block's backward runs through another
    block, so blocks are independent: a job may train a subset (``layers``) and
    ``tools/model_converters/merge_aligned_blocks.py`` merges subsets trained in parallel.

    Trained: everything under ``layers.N.attn.`` of the selected blocks (``qkv``, ``proj``
    and the operator's own parameters: MHLA's mixing and value conv, TTT's inner weights and
    position encoding, hedgehog's feature maps). Frozen: everything else.

    The student is initialised from the teacher: after both models' own initialisation,
    every tensor the teacher has is copied into it (the ``fullcopy`` setting of
    ``SoftmaxTransfer``; operator-specific tensors keep their own init). The student config
    therefore takes no ``init_cfg``. The checkpoint of a run holds the student alone under
    ``backbone.*``, as an ``ImageClassifier`` names it; with ``StagedRecordHook`` it records
    the operators and the trained blocks, and ``LinearViTCheckpoint`` loads it strictly into
    the next stage.

    Labels are ignored; no gradient clipping should span blocks (a global norm couples them,
    and a subset job would then differ from the whole).

    Args:
        backbone (dict): the student LinearViT config (any linear operator), without
            ``init_cfg``.
        teacher (dict): the Softmax teacher LinearViT config, with an ``init_cfg`` that loads
            its weights.
        layers (Sequence[int], optional): blocks to train (negative ones count from the end).
            By default every block whose operator is not Softmax: the Softmax blocks of a
            hybrid student are the teacher's own, copied, with nothing to align (list them to
            train them anyway). Empty or out-of-range lists, and a block listed twice, are
            refused.
        loss_weight (float): lambda, a finite number > 0. Defaults to 1 (with AdamW the scale
            hardly matters; it only rescales the logged loss).
        with_cp (bool): recompute each student block's attention in the backward instead of
            keeping its activations (``torch.utils.checkpoint``): the step then keeps, per
            block, little more than the two outputs compared, for one more attention forward.
            The results are the same. Defaults to True.
        patch_tokens_only, data_preprocessor, init_cfg: see :class:`BaseAligner`.
    """

    STAGE = 'align-attn'

    def __init__(self, backbone, teacher, layers=None, loss_weight=1.0, with_cp=True,
                 patch_tokens_only=None, data_preprocessor=None, init_cfg=None):
        if isinstance(backbone, dict) and backbone.get('init_cfg') is not None:
            raise ValueError(
                f'AttentionAligner initialises the student from the teacher (fullcopy), so the '
                f"student config takes no init_cfg; got {backbone['init_cfg']!r}. To continue "
                f'from an earlier alignment run, use load_from / --resume')
        self.loss_weight = pairing.check_loss_weight(
            loss_weight, positive=True, note=' (the only loss of the stage)')
        if not isinstance(with_cp, bool):
            raise TypeError(f'with_cp must be True or False, got {with_cp!r}')
        self.with_cp = with_cp
        super().__init__(backbone, teacher, patch_tokens_only=patch_tokens_only,
                         data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.layer_ids, _ = pairing.resolve_layers(
            pairing.attention_modules(self.backbone), layers, 'align', all_softmax='refuse')
        if self.backbone.frozen_stages > 0:  # a LinearViT (checked at build) always has it
            raise ValueError(f'the student sets frozen_stages={self.backbone.frozen_stages}, '
                             f'which would freeze the attention of its first blocks again at '
                             f'every train(); AttentionAligner freezes everything but the '
                             f'attention of `layers` itself: leave frozen_stages unset')
        self.backbone.requires_grad_(False)
        for index in self.layer_ids:
            self.backbone.layers[index].attn.requires_grad_(True)

    def init_weights(self):
        """The teacher's weights, the student's own init, then the teacher's tensors copied
        into the student (``fullcopy``)."""
        # Imported here: linvit_mm.transfer imports the models package this module is part of.
        from linvit_mm.transfer import transfer_softmax_weights
        super().init_weights()
        teacher_state = {f'backbone.{k}': v for k, v in self.teacher.state_dict().items()}
        transfer_softmax_weights(self.backbone, teacher_state, setting='fullcopy',
                                 num_heads=self.teacher.num_heads, logger='current')

    def staged_record(self):
        return dict(stage=self.STAGE, trained_layers=list(self.layer_ids))

    # ------------------------------------------------------------------ forward
    def _student_attention(self, index, x, hw_shape):
        """Student block ``index`` on the teacher's input ``x`` to that block: its position
        encoding, its (frozen) ``ln1``, its attention."""
        if self.patch_input:
            x = x[:, self.teacher_extra:]
        block = self.backbone.layers[index]
        return block.attn(block.ln1(block.attn.encode_position(x, hw_shape)), hw_shape)

    def block_pairs(self, images):
        """``[(student output, teacher output), ...]`` per selected block, restricted to the
        tokens both compare.

        Teacher and student alternate block by block, so a teacher block input is dropped once
        the student block has used it; the teacher stops after the last selected block.
        """
        teacher = self.teacher
        with torch.no_grad():
            x, hw_shape = teacher.embed(images)
        wanted = set(self.layer_ids)
        recorded = {}

        def record(module, args, output):
            recorded['output'] = output

        handles = [teacher.layers[index].attn.register_forward_hook(record)
                   for index in self.layer_ids]
        pairs = []
        try:
            for index, layer in enumerate(teacher.layers[:max(self.layer_ids) + 1]):
                with torch.no_grad():
                    next_x = layer(x, hw_shape)
                if index in wanted:
                    args = (index, x.detach(), hw_shape)
                    if self.with_cp and torch.is_grad_enabled():
                        student = checkpoint(self._student_attention, *args,
                                             use_reentrant=False)
                    else:
                        student = self._student_attention(*args)
                    pairs.append(self.comparable(student, recorded.pop('output')))
                x = next_x
        finally:
            for handle in handles:
                handle.remove()
        return pairs

    def loss(self, inputs):
        total = sum(F.mse_loss(student.float(), teacher.float())
                    for student, teacher in self.block_pairs(inputs))
        return dict(loss_align=self.loss_weight * total)

    def extract(self, inputs):
        return tuple(student for student, _ in self.block_pairs(inputs))
