"""Attention-output distillation from a frozen Softmax teacher (paper §3.2)."""
import weakref

import torch
import torch.nn.functional as F
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS, DefaultScope

from linvit_mm.models import pairing
# align_tokens was importable from here before the pairing rules had a module of their own
from linvit_mm.models.pairing import align_tokens  # noqa: F401
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


@HOOKS.register_module()
class AttentionDistillHook(Hook):
    """Adds ``loss_weight * sum_blocks MSE(student_attn_out, teacher_attn_out)`` to the loss.

    Exactly: ``loss_distill = loss_weight * sum over the distilled blocks b of
    mean((s_b - t_b) ** 2)``, a **sum** over blocks (as in the paper's formula) of per-block
    mean squared errors, each a **mean** over batch, compared tokens and channels (over
    batch, heads and both token axes for ``target='map'``). ``s_b`` is what block ``b``'s
    attention module returns (after ``proj``), ``t_b`` the same of the teacher's block
    ``b``. The compared tokens: all of them when both sequences lead with the same extra
    tokens (class token, registers); the patch tokens alone (the last ``H*W`` of each
    sequence, so a teacher's class token or register is never matched with a student's
    patch) when they do not (a student without class token, a teacher with registers the
    student lacks) or ``patch_tokens_only`` is set. The rules of the pairing live in
    :mod:`linvit_mm.models.pairing`.

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
    blocks; maps on both sides for ``target='map'``; a Softmax teacher with an
    ``init_cfg`` to load its weights).

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
            when the student's extra tokens are not the teacher's (mhla and ttt have no
            class token; a register teacher).
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
        self.loss_weight = pairing.check_loss_weight(
            loss_weight, note=' (lambda, 50 in the paper; 0 switches the distillation loss off)')
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
        student_attn = pairing.attention_modules(student)
        if not student_attn:
            raise ValueError(f'AttentionDistillHook: {self.student_path!r} holds no attention '
                             f'operator (linvit_mm BaseAttention) to distil into')
        if self.target == 'map':
            mapless = pairing.mapless_operators(student_attn)
            if mapless:
                raise ValueError(f"target='map' needs attention maps, which the {mapless} "
                                 f"operator(s) of the student do not have; use "
                                 f"target='output'")
        layer_ids, skipped = pairing.resolve_layers(student_attn, self.layers, 'distil')

        device = next(student.parameters()).device
        self.teacher = self.build_teacher(device)
        self._check_teacher(runner, student, layer_ids)
        # Every token is compared only where both sequences carry the same extra tokens.
        self.patch_tokens_only = pairing.patch_tokens_only(
            pairing.token_layout(student), pairing.token_layout(self.teacher),
            self.patch_tokens_only)

        with_maps = self.target == 'map'
        self._student_rec = _Recorder(student_attn, layer_ids, with_maps)
        self._teacher_rec = _Recorder(pairing.attention_modules(self.teacher), layer_ids,
                                      with_maps)
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

    def _check_teacher(self, runner, student, layer_ids):
        """Refuse a teacher that cannot be matched with the student, naming every mismatch."""
        pairing.refuse(pairing.fit_problems(
            student, self.teacher, layer_ids, allow_non_softmax=self.allow_non_softmax_teacher,
            non_softmax_advice="set the teacher's attn_type='softmax', or "
            'allow_non_softmax_teacher=True to distil from it deliberately',
            target=self.target), 'AttentionDistillHook: the teacher does not fit the student')
        non_softmax = pairing.non_softmax_operators(pairing.attention_modules(self.teacher))
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
