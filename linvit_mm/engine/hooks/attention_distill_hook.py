"""Attention-output distillation from a frozen Softmax teacher (paper §3.2)."""
import math
import numbers
import weakref

import torch
import torch.nn.functional as F
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS, DefaultScope
from mmengine.utils import to_2tuple

from linvit_mm.models.attention import BaseAttention, attention_class
from linvit_mm.utils.blocks import block_index_list, is_block_index


class _Recorder:
    """Collects what the attention modules of one model produce during one forward."""

    def __init__(self, attn_modules, layer_ids, with_maps):
        self.layer_ids = layer_ids
        self.with_maps = with_maps
        self.outputs = {}
        self.maps = {}
        self.num_patches = None
        self.active = False
        self.handles = []
        for index in layer_ids:
            module = attn_modules[index]
            self.handles.append(module.register_forward_hook(self._make_hook(index, module)))

    def _make_hook(self, index, module):
        # A plain closure holding weak references: deep copies of the model (EMA)
        # keep the function object as is and never drag the recorder along.
        recorder_ref = weakref.ref(self)
        module_ref = weakref.ref(module)

        def record(mod, args, output):
            recorder = recorder_ref()
            if recorder is None or mod is not module_ref() or not recorder.active:
                return
            # BaseAttention.forward(x, hw_shape) returns the (B, N, C) output tensor
            recorder.outputs[index] = output
            height, width = args[1]
            recorder.num_patches = height * width
            if recorder.with_maps:
                recorder.maps[index] = mod.attention_map(*args)

        return record

    def start(self):
        self.active = True

    def stop(self):
        self.active = False

    def clear(self):
        self.outputs.clear()
        self.maps.clear()

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _attention_modules(model):
    return [m for m in model.modules() if isinstance(m, BaseAttention)]


def _patch_size(model):
    """The patch size of the first (outermost) module of ``model`` that declares one."""
    for module in model.modules():
        size = getattr(module, 'patch_size', None)
        if size is not None:
            return to_2tuple(size)
    return None


def align_tokens(student, teacher, num_patches, patch_only, is_map):
    """Make student and teacher tokens comparable.

    Both sequences end with the same ``num_patches`` patch tokens (same image, same
    grid); a class token, where present, leads. Everything is compared when the
    sequences match, the patch tokens only when they do not (a student without class
    token) or when asked. ``is_map``: ``(..., N, N)`` maps, aligned on both token axes.
    """
    if student.shape[-2] == teacher.shape[-2] and not patch_only:
        return student, teacher
    patches = slice(-num_patches, None)
    index = (..., patches, patches) if is_map else (..., patches, slice(None))
    return student[index], teacher[index]


@HOOKS.register_module()
class AttentionDistillHook(Hook):
    """Adds ``loss_weight * sum_blocks MSE(student_attn_out, teacher_attn_out)`` to the loss.

    Exactly: ``loss_distill = loss_weight * sum over the distilled blocks b of
    mean((s_b - t_b) ** 2)``, a **sum** over blocks (as in the paper's formula) of per-block
    mean squared errors, each a **mean** over batch, compared tokens and channels (over
    batch, heads and both token axes for ``target='map'``). ``s_b`` is what block ``b``'s
    attention module returns (after ``proj``), ``t_b`` the same of the teacher's block
    ``b``. The compared tokens: all of them when both sides carry the same tokens; the
    patch tokens alone (the last ``H*W`` of each sequence, so a teacher's class token is
    never matched with a student's first patch) when the student has no class token or
    ``patch_tokens_only`` is set.

    The teacher is built from its own config (and checkpoint, through its
    ``init_cfg``) in ``before_train``, on the student's device, frozen and in eval
    mode. It is held by this hook (``hook.teacher``, between ``before_train`` and
    ``after_train``), not by the model, so it is never trained, never in the
    optimizer, a checkpoint, an EMA copy or the student's ``state_dict``, and
    ``--resume`` rebuilds it from the config.

    Every training forward, a pre-forward hook on the student module (``student``,
    default the classifier's ``backbone``) hands the teacher the very tensor the
    student receives, i.e. the batch after the data preprocessor (and after
    Mixup/CutMix). Forward hooks on the attention modules of both record every
    block's attention output, and a forward hook on the model adds
    ``loss_distill`` to the loss dict the model returns, so it is part of backward,
    summed by ``parse_losses`` and logged (a model entry named plain ``loss`` is
    logged as ``loss_task`` so that ``loss`` stays the total).

    A set-up that cannot distil is refused before the first iteration: the
    arguments when the hook is built, the student/teacher pairing in
    ``before_train`` (block count, width, heads and patch size of the distilled
    blocks; maps on both sides for ``target='map'``; a Softmax teacher).

    Args:
        teacher (dict): model config of the teacher (a ``LinearViT`` with
            ``attn_type='softmax'`` and an ``init_cfg`` that loads its weights).
        loss_weight (float): lambda, a finite number >= 0. Defaults to 50 (the paper).
        target (str): ``'output'`` matches attention outputs (the paper's choice);
            ``'map'`` matches attention maps (ablation; student and teacher operators
            both need a map).
        layers (Sequence[int], optional): block indices to match (negative ones count
            from the end). By default every block whose operator is not Softmax: all
            blocks of a linear student; in a hybrid (``attn_type`` with Softmax in some
            blocks) its Softmax blocks are skipped, and the log says which. Such a block
            already runs the teacher's operator (FullCopy gives it the teacher's weights),
            so there is nothing to transfer into it: its output differs from the teacher's
            only through what the linear blocks before it changed in its input, which the
            terms of the following linear blocks already measure, and matching it anyway
            would train the Softmax attention to compensate for them instead of keeping the
            teacher's. List them here to match them too. A student that is Softmax
            throughout matches every block. An empty list is refused, and so is a block
            listed twice (``[0, 0]``, or ``[11, -1]`` in 12 blocks).
        patch_tokens_only (bool, optional): compare patch tokens only. Forced on
            when the student has no class token (mhla, ttt).
        stop_epoch / stop_iter (int, optional): switch distillation off from this
            epoch / iteration on (0-based, as ``runner.epoch`` / ``runner.iter``).
        student (str): path of the student module inside the model.
        allow_non_softmax_teacher (bool): distil from a teacher whose attention is not
            Softmax (e.g. a trained linear ViT). Refused unless set; when set and used,
            the run's log says so at WARNING level. Defaults to False.
    """

    priority = 'NORMAL'
    TARGETS = ('output', 'map')

    def __init__(self, teacher, loss_weight=50.0, target='output', layers=None,
                 patch_tokens_only=None, stop_epoch=None, stop_iter=None, student='backbone',
                 allow_non_softmax_teacher=False):
        if target not in self.TARGETS:
            raise ValueError(f'unknown distillation target {target!r}; choose from '
                             f'{self.TARGETS}')
        if not isinstance(teacher, dict) or 'type' not in teacher:
            raise TypeError(f'teacher must be a model config dict with a type, got {teacher!r}')
        self.teacher_cfg = teacher
        self.loss_weight = self._check_loss_weight(loss_weight)
        self.target = target
        self.layers = block_index_list(layers, 'distil')
        if patch_tokens_only not in (None, True, False):
            raise TypeError(f'patch_tokens_only must be None (automatic), True or False, got '
                            f'{patch_tokens_only!r}')
        self.patch_tokens_only = patch_tokens_only
        for name, value in (('stop_epoch', stop_epoch), ('stop_iter', stop_iter)):
            if value is not None and not (is_block_index(value) and value >= 0):
                raise ValueError(f'{name} must be None (never stop) or an int >= 0 (0-based, '
                                 f'distillation is off from that {name[5:]} on), got {value!r}')
        self.stop_epoch = stop_epoch
        self.stop_iter = stop_iter
        if not isinstance(student, str) or not student:
            raise TypeError(f'student must be the path of a module of the model (e.g. '
                            f"'backbone'), got {student!r}")
        self.student_path = student
        if not isinstance(allow_non_softmax_teacher, bool):
            raise TypeError(f'allow_non_softmax_teacher must be True or False, got '
                            f'{allow_non_softmax_teacher!r}')
        self.allow_non_softmax_teacher = allow_non_softmax_teacher
        self.teacher = None
        self._handles = []
        self._student_rec = self._teacher_rec = None
        self._enabled = False

    @staticmethod
    def _check_loss_weight(loss_weight):
        if not isinstance(loss_weight, numbers.Real) or isinstance(loss_weight, bool):
            raise TypeError(f'loss_weight must be a number (lambda, 50 in the paper), got '
                            f'{loss_weight!r} of type {type(loss_weight).__name__}')
        if not (math.isfinite(loss_weight) and loss_weight >= 0):
            raise ValueError(f'loss_weight must be a finite number >= 0 (lambda, 50 in the '
                             f'paper; 0 switches the distillation loss off), got {loss_weight!r}')
        return float(loss_weight)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _unwrap(model):
        return model.module if is_model_wrapper(model) else model

    def build_teacher(self, device):
        from mmpretrain.registry import MODELS
        with DefaultScope.overwrite_default_scope('mmpretrain'):
            teacher = MODELS.build(self.teacher_cfg)
        teacher.init_weights()
        teacher.to(device)
        teacher.eval()
        teacher.requires_grad_(False)
        return teacher

    def before_train(self, runner):
        model = self._unwrap(runner.model)
        try:
            student = model.get_submodule(self.student_path)
        except AttributeError as err:
            raise ValueError(f'AttentionDistillHook: the model has no module '
                             f'{self.student_path!r} (set student=...)') from err
        student_attn = _attention_modules(student)
        if not student_attn:
            raise ValueError(f'AttentionDistillHook: {self.student_path!r} holds no attention '
                             f'operator (linvit_mm BaseAttention) to distil into')
        if self.target == 'map':
            mapless = sorted({m.attn_type for m in student_attn if not m.has_map})
            if mapless:
                raise ValueError(f"target='map' needs attention maps, which the {mapless} "
                                 f"operator(s) of the student do not have; use "
                                 f"target='output'")
        num_blocks = len(student_attn)
        softmax = attention_class('softmax')
        softmax_blocks = [i for i, m in enumerate(student_attn) if isinstance(m, softmax)]
        skipped = []
        if self.layers is not None:
            layer_ids = self.layers
        elif len(softmax_blocks) < num_blocks:
            skipped = softmax_blocks
            layer_ids = [i for i in range(num_blocks) if i not in softmax_blocks]
        else:
            layer_ids = list(range(num_blocks))
        bad = [i for i in layer_ids if not -num_blocks <= i < num_blocks]
        if bad:
            raise ValueError(f'layers {bad} are outside the {num_blocks} blocks of the student; '
                             f'use indices in [{-num_blocks}, {num_blocks - 1}]')
        blocks = [i % num_blocks for i in layer_ids]
        twice = sorted({block for block in blocks if blocks.count(block) > 1})
        if twice:
            # as attn_type refuses them: a block listed twice is distilled once, not twice
            raise ValueError(f'layers {list(layer_ids)} name block(s) {twice} more than once '
                             f'(negative indices count from the end of the {num_blocks} '
                             f'blocks); list each block once')
        layer_ids = sorted(set(blocks))

        device = next(student.parameters()).device
        self.teacher = self.build_teacher(device)
        teacher_attn = _attention_modules(self.teacher)
        self._check_teacher(runner, student, student_attn, teacher_attn, layer_ids)

        if self.patch_tokens_only is None:
            self.patch_tokens_only = False
        if not getattr(student, 'with_cls_token', True):
            self.patch_tokens_only = True

        with_maps = self.target == 'map'
        self._student_rec = _Recorder(student_attn, layer_ids, with_maps)
        self._teacher_rec = _Recorder(teacher_attn, layer_ids, with_maps)
        self._handles = [
            student.register_forward_pre_hook(self._run_teacher),
            model.register_forward_hook(self._add_loss, with_kwargs=True),
        ]
        runner.logger.info(
            f'AttentionDistillHook: {self.target} distillation of blocks {layer_ids} from a '
            f'frozen {type(self.teacher).__name__} teacher, loss_weight={self.loss_weight}, '
            f'patch_tokens_only={self.patch_tokens_only}')
        if skipped:
            runner.logger.info(
                f'AttentionDistillHook: the student is a hybrid; its Softmax blocks {skipped} '
                f"run the teacher's operator and are not matched (give layers=[...] to match "
                f'them too)')

    def _check_teacher(self, runner, student, student_attn, teacher_attn, layer_ids):
        """Refuse a teacher that cannot be matched with the student, naming every mismatch."""
        if len(teacher_attn) != len(student_attn):
            raise ValueError(f'teacher has {len(teacher_attn)} attention blocks, the student '
                             f'{len(student_attn)}; they must match block for block (build the '
                             f"teacher with the student's arch)")
        problems = []
        softmax = attention_class('softmax')
        non_softmax = sorted({m.attn_type for m in teacher_attn if not isinstance(m, softmax)})
        if non_softmax and not self.allow_non_softmax_teacher:
            problems.append(f"the teacher's attention is {non_softmax}, not Softmax: set the "
                            f"teacher's attn_type='softmax', or allow_non_softmax_teacher=True "
                            f'to distil from it deliberately')
        if self.target == 'map':
            mapless = sorted({m.attn_type for m in teacher_attn if not m.has_map})
            if mapless:
                problems.append(f"target='map' needs attention maps, which the {mapless} "
                                f"operator(s) of the teacher do not have; use target='output' or "
                                f'a teacher whose operator has a map')
        for trait, what in (('embed_dims', 'width'), ('num_heads', 'head count')):
            differ = [f'block {i}: {getattr(student_attn[i], trait)} vs '
                      f'{getattr(teacher_attn[i], trait)}' for i in layer_ids
                      if getattr(student_attn[i], trait) != getattr(teacher_attn[i], trait)]
            if differ:
                problems.append(f"the teacher's {what} ({trait}) differs from the student's "
                                f"(student vs teacher: {'; '.join(differ)}); build the teacher "
                                f"with the student's arch")
        student_patch, teacher_patch = _patch_size(student), _patch_size(self.teacher)
        if None not in (student_patch, teacher_patch) and student_patch != teacher_patch:
            problems.append(f'the teacher cuts {teacher_patch} patches, the student '
                            f'{student_patch}, so their tokens do not correspond; set the '
                            f"teacher's patch_size to the student's")
        if problems:
            raise ValueError('AttentionDistillHook: the teacher does not fit the student:\n  - '
                             + '\n  - '.join(problems))
        if non_softmax:
            runner.logger.warning(
                f"AttentionDistillHook: distilling from a non-Softmax teacher ({non_softmax} "
                f'attention), allowed by allow_non_softmax_teacher=True')

    # ------------------------------------------------------------------ per iteration
    def _distilling(self, runner):
        if self.stop_epoch is not None and runner.epoch >= self.stop_epoch:
            return False
        if self.stop_iter is not None and runner.iter >= self.stop_iter:
            return False
        return True

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._enabled = self.teacher is not None and self._distilling(runner)
        if self.teacher is not None:
            self.teacher.eval()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._enabled = False
        for recorder in (self._student_rec, self._teacher_rec):
            if recorder is not None:
                recorder.stop()
                recorder.clear()

    def _run_teacher(self, student, args):
        if not (self._enabled and student.training):
            return
        self._student_rec.start()
        self._teacher_rec.start()
        with torch.no_grad():
            self.teacher(args[0])
        self._teacher_rec.stop()

    def _add_loss(self, model, args, kwargs, output):
        if not (self._enabled and model.training and kwargs.get('mode') == 'loss'
                and self._student_rec.active):
            return None
        self._student_rec.stop()
        if not isinstance(output, dict):
            raise TypeError(f'AttentionDistillHook expects the model to return a loss dict in '
                            f'mode="loss", got {type(output)}')
        source = 'maps' if self.target == 'map' else 'outputs'
        student_rec, teacher_rec = getattr(self._student_rec, source), getattr(
            self._teacher_rec, source)
        missing = [i for i in self._student_rec.layer_ids
                   if i not in student_rec or i not in teacher_rec]
        if missing:
            raise RuntimeError(f'AttentionDistillHook recorded no attention for blocks '
                               f'{missing}; does the student run all its blocks?')
        loss = 0.
        for index in self._student_rec.layer_ids:
            student_value, teacher_value = align_tokens(
                student_rec[index], teacher_rec[index], self._student_rec.num_patches,
                self.patch_tokens_only, is_map=self.target == 'map')
            loss = loss + F.mse_loss(student_value.float(), teacher_value.float())
        output = dict(output)
        if 'loss' in output:
            # parse_losses logs the total as 'loss' and then lets a model entry of the
            # same name overwrite it (mmpretrain heads return 'loss'); renamed, the
            # log shows the total, the task loss and the distillation loss.
            output['loss_task'] = output.pop('loss')
        output['loss_distill'] = self.loss_weight * loss
        return output

    def after_train(self, runner):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for recorder in (self._student_rec, self._teacher_rec):
            if recorder is not None:
                recorder.remove()
        self.teacher = None
