"""Strict loading of the checkpoints mmengine's Runner puts into a LinearViT model.

The Runner loads ``load_from`` (and ``tools/test.py CHECKPOINT``) with ``strict=False`` and
resumes from whatever file it is given: a checkpoint of another head or of an alignment stage
loads what fits, and a ``relu`` run's checkpoint resumes an ``elu`` run without a word, since
the two operators have the same tensors. For models that hold a LinearViT,
:func:`check_runner_checkpoint` (``tools/train.py`` and ``tools/test.py`` call it once the
Runner is built, before the model's weights are initialised or anything is loaded) applies the
rule of ``LinearViTCheckpoint``:

* the record a checkpoint carries (``meta['linvit_mm']``: each LinearViT's operator, heads,
  operator options that change what it computes (a feature map, a normaliser, eps, RoPE) and
  attention window per block, width, depth, patch size, extra tokens, and the stage of an
  aligner) must match the model the config builds;
* every tensor of the model must be in the checkpoint with its shape, and the checkpoint may
  hold no other;
* a run resumes only from a run checkpoint (optimizer and loop state) of the same model.

A mismatch raises :class:`CheckpointMismatchError` naming the file, each field (checkpoint
value, config value) and the keys. ``strict_load = False`` in the config (``--no-strict-load``
on the tools) loads what fits instead and lists the rest at WARNING level; a resume still
needs every tensor to fit, as the optimizer state belongs to them.

A checkpoint without a record (older runs, converted releases) is checked by names and shapes
and loads with a WARNING that its operators could not be compared. Models without a LinearViT
(a plain mmpretrain ResNet, say) load as mmengine loads them, except that a resume file whose
meta carries a ``config`` text (which mmengine's resume would execute) is refused for them too.

:class:`ModelRecordHook`, which ``add_training_safeguards`` gives every training run, writes
the record into each checkpoint.
"""
import re

from mmengine.hooks import Hook
from mmengine.model import BaseTTAModel, is_model_wrapper
from mmengine.registry import HOOKS

from linvit_mm.staged import RECORD_KEY, checkpoint_record, find_linear_vits, model_record
from linvit_mm.staged.record import ARCH_FIELDS, block_ranges, option_differences
from linvit_mm.transfer.formats import refuse_non_finite_checkpoint
from linvit_mm.utils.checkpoint_state import state_problems

__all__ = ['STRICT_LOAD_KEY', 'CheckpointMismatchError', 'ModelRecordHook',
           'check_runner_checkpoint', 'checkpoint_fit', 'describe_preprocessing',
           'pending_checkpoint']

# The config key of the opt-out (``strict_load = False``).
STRICT_LOAD_KEY = 'strict_load'
# mmengine's Runner.load_checkpoint strips this from every key before loading.
_REVISE_KEYS = [(r'^module.', '')]


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model of the config; nothing was loaded."""


def _unwrap(model):
    """The model a checkpoint's keys name: mmengine's ``load_state_dict`` looks through model
    wrappers and test-time-augmentation models (``tools/test.py --tta``) alike."""
    while is_model_wrapper(model) or isinstance(model, BaseTTAModel):
        model = model.module
    return model


@HOOKS.register_module()
class ModelRecordHook(Hook):
    """Writes the record of the model's LinearViTs (and, for an aligner, its stage) into
    ``checkpoint['meta']['linvit_mm']`` at every save, so that a later ``--resume``,
    ``load_from`` or ``tools/test.py`` can compare it with its own model before loading.

    Unlike ``StagedRecordHook`` it does nothing for a model without a LinearViT, so that the
    training tools can give it to every run.
    """

    priority = 'NORMAL'

    def before_save_checkpoint(self, runner, checkpoint):
        model = _unwrap(runner.model)
        if find_linear_vits(model):
            # Updated, not replaced: other hooks may add their own entries to the record.
            meta = checkpoint.setdefault('meta', {})
            record = meta.get(RECORD_KEY)
            meta[RECORD_KEY] = {**(record if isinstance(record, dict) else {}),
                                **model_record(model)}
            # What the model's inputs were normalised with: an aligner whose teacher this
            # model becomes compares its own preprocessing with it.
            preprocessing = describe_preprocessing(getattr(model, 'data_preprocessor', None))
            if preprocessing is not None:
                meta[RECORD_KEY]['preprocessing'] = preprocessing


def describe_preprocessing(data_preprocessor):
    """``{'mean': [...], 'std': [...], 'to_rgb': bool}`` of a normalising image preprocessor
    (mmpretrain's ``ClsDataPreprocessor`` and its kin), else None."""
    if not getattr(data_preprocessor, '_enable_normalize', False):
        return None
    mean, std = getattr(data_preprocessor, 'mean', None), getattr(data_preprocessor, 'std', None)
    if mean is None or std is None:
        return None
    return dict(mean=[round(float(v), 6) for v in mean.flatten()],
                std=[round(float(v), 6) for v in std.flatten()],
                to_rgb=bool(getattr(data_preprocessor, 'to_rgb', False)))


def pending_checkpoint(runner):
    """``(filename, resume)`` of what ``runner.load_or_resume()`` is going to load, or None.

    Mirrors the decision of mmengine's ``Runner`` and ``FlexibleRunner``: ``resume`` with a
    path (or ``load_from``) resumes from it, ``resume`` alone from the latest checkpoint of the
    work dir, ``load_from`` alone loads weights.
    """
    from mmengine.runner import find_latest_checkpoint
    if getattr(runner, '_has_loaded', False):
        return None
    resume, load_from = getattr(runner, '_resume', False), getattr(runner, '_load_from', None)
    if isinstance(resume, str):  # FlexibleRunner takes the path as resume=...
        return resume, True
    if resume:
        filename = load_from if load_from is not None else find_latest_checkpoint(
            runner.work_dir)
        if filename is not None:
            return filename, True
        return None
    return (load_from, False) if load_from is not None else None


def _stage_names():
    """The stages aligners state: their checkpoints hold a student without a head and load
    into the same aligner only."""
    from linvit_mm.models.aligners import BaseAligner

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    return {sub.STAGE for sub in subclasses(BaseAligner) if isinstance(
        getattr(sub, 'STAGE', None), str)}


def _per_block(field, prefix, recorded, expected):
    if not isinstance(recorded, list) or len(recorded) != len(expected):
        return [] if isinstance(recorded, list) else [
            f'{field} ({prefix}): not recorded in the checkpoint, config {expected!r}']
    groups = {}
    for index, (have, want) in enumerate(zip(recorded, expected)):
        if have != want:
            groups.setdefault((have, want), []).append(index)
    return [f'{field} of blocks {block_ranges(blocks)} ({prefix}): checkpoint {have!r}, '
            f'config {want!r}' for (have, want), blocks in groups.items()]


def _vit_differences(prefix, recorded, expected):
    problems = []
    for field in ARCH_FIELDS:
        have, want = recorded.get(field), expected.get(field)
        if field == 'patch_size' and isinstance(have, (list, tuple)):
            have = list(have)
        if have != want:
            problems.append(f'{field} ({prefix}): checkpoint {have!r}, config {want!r}')
    problems += _per_block('attn_type', prefix, recorded.get('attn_types'),
                           expected['attn_types'])
    problems += _per_block('num_heads', prefix, recorded.get('num_heads'),
                           expected['num_heads'])
    problems += [f'{what} of blocks {block_ranges(blocks)} ({prefix}): checkpoint {have!r}, '
                 f'config {want!r}'
                 for what, blocks, have, want in option_differences(recorded, expected)]
    return problems


def _record_problems(model, recorded, resume):
    """How the checkpoint's record differs from ``model``'s, as readable lines."""
    expected = model_record(model)
    problems = []
    have_vits, want_vits = recorded.get('backbones') or {}, expected['backbones']
    for prefix, described in want_vits.items():
        if prefix not in have_vits:
            problems.append(f'LinearViT at {prefix!r}: the checkpoint records none there '
                            f'(it records {sorted(have_vits) or "none"})')
        elif isinstance(have_vits[prefix], dict):
            problems += _vit_differences(prefix, have_vits[prefix], described)
    for prefix in sorted(set(have_vits) - set(want_vits)):
        problems.append(f'LinearViT at {prefix!r}: in the checkpoint, not in the config\'s '
                        f'model')
    model_name = type(model).__name__
    have_stage, want_stage = recorded.get('stage'), expected.get('stage')
    stages = _stage_names()
    if have_stage != want_stage and (have_stage in stages or want_stage is not None):
        problems.append(f'stage: checkpoint {have_stage!r}, config {want_stage!r} (the config '
                        f'builds {model_name})')
    elif resume and want_stage is not None:
        for key in sorted(set(expected) - {'backbones', 'stage'}):
            if recorded.get(key) != expected[key]:
                problems.append(f'{key} ({want_stage}): checkpoint {recorded.get(key)!r}, '
                                f'config {expected[key]!r}')
    return problems


def _tensor_problems(model, state_dict):
    for pattern, replacement in _REVISE_KEYS:
        state_dict = {re.sub(pattern, replacement, key): value
                      for key, value in state_dict.items()}
    return state_problems(model.state_dict(), state_dict, vits=find_linear_vits(model),
                          against='config')


def _run_problems(checkpoint):
    """Why a run cannot resume from this file, beyond its tensors."""
    problems = []
    lacking = [key for key in ('optimizer', 'message_hub', 'meta') if key not in checkpoint]
    if lacking:
        problems.append(f'not a run checkpoint: it has no {", ".join(lacking)} (a run resumes '
                        f'only from a checkpoint a run wrote)')
    meta = checkpoint.get('meta')
    if isinstance(meta, dict):
        loop = [key for key in ('epoch', 'iter') if key not in meta]
        if loop:
            problems.append(f'its meta has no {" or ".join(loop)} to resume the loop from')
    return problems + _code_problems(checkpoint)


def _code_problems(checkpoint):
    """What in a resume file mmengine's ``Runner.resume`` would run as code, for any model."""
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    if isinstance(meta, dict) and 'config' in meta:
        # mmengine's resume parses meta['config'] with Config.fromstring, which runs it.
        return ["its meta holds a 'config' text, which mmengine's resume would run as "
                "Python; runs of mmengine write meta['cfg'] instead"]
    return []


def checkpoint_fit(model, checkpoint, resume=False):
    """How a loaded checkpoint fits ``model`` (unwrapped).

    Returns:
        dict: ``record`` (differences of the recorded LinearViTs and stage), ``tensors``
        (missing, unexpected and size-mismatched keys), ``run`` (for ``resume``: why the
        file cannot resume a run) as lists of lines, and ``recorded`` (whether the checkpoint
        carries a record at all).
    """
    if not isinstance(checkpoint, dict):
        return dict(record=[], tensors=[f'holds a {type(checkpoint).__name__}, not a state '
                                        f'dict or run checkpoint'], run=[], recorded=False)
    recorded = checkpoint_record(checkpoint)
    state_dict = checkpoint.get('state_dict', checkpoint)
    if not isinstance(state_dict, dict):
        return dict(record=[], tensors=['its state_dict is not a dict'], run=[],
                    recorded=recorded is not None)
    return dict(
        record=[] if recorded is None else _record_problems(model, recorded, resume),
        tensors=_tensor_problems(model, state_dict),
        run=_run_problems(checkpoint) if resume else [],
        recorded=recorded is not None)


def _opt_out_hint(resume):
    if resume:
        return ('A run resumes only from a checkpoint of the same model (the optimizer state '
                'belongs to its tensors); to start a new run from these weights, use '
                'load_from (with --no-strict-load / strict_load = False for a partial load)')
    return ('To load what fits anyway and keep the rest as initialised, pass --no-strict-load '
            '(tools/train.py, tools/test.py) or set strict_load = False in the config')


def check_runner_checkpoint(runner, strict=None, allow_non_finite=True):
    """Check what ``runner`` is going to load (:func:`pending_checkpoint`) against its model,
    before anything loads. A resume file is refused for any model when mmengine's resume would
    run text it carries as code; the rest of the check applies to models with a LinearViT.

    Args:
        runner: an mmengine ``Runner`` / ``FlexibleRunner``, built, not yet trained or tested.
        strict (bool, optional): refuse any mismatch. By default the config's ``strict_load``
            (True when unset).
        allow_non_finite (bool): load weights that hold NaN or Inf. ``tools/test.py`` refuses
            them (a NaN model scores 0 and exits 0); a training run's ``FiniteLossHook``
            refuses them itself, once loaded.

    Returns:
        list[str]: what the check found and let through (already logged at WARNING level).

    Raises:
        CheckpointMismatchError: the checkpoint does not fit (strict), or cannot resume the run
            (its tensors do not fit or it is no run checkpoint, even with ``strict=False``).
    """
    from mmengine.runner.checkpoint import _load_checkpoint
    pending = pending_checkpoint(runner)
    if pending is None:
        return []
    model = _unwrap(runner.model)
    filename, resume = pending
    linear = bool(find_linear_vits(model))
    if not linear and not resume and allow_non_finite:
        return []  # nothing to check: mmengine loads it as it loads it
    checkpoint = _load_checkpoint(filename, map_location='cpu')
    if not allow_non_finite:
        refuse_non_finite_checkpoint(checkpoint, filename, advice=(
            'Nothing was loaded; pass --allow-non-finite to load it anyway (to inspect a '
            'diverged run).'))
    if not linear:
        code = _code_problems(checkpoint) if resume else []
        if code:
            raise CheckpointMismatchError(
                f'{filename} cannot be resumed, whatever the model; nothing was loaded:\n  - '
                + '\n  - '.join(code))
        return []
    if strict is None:
        strict = runner.cfg.get(STRICT_LOAD_KEY, True)
    if not isinstance(strict, bool):
        raise TypeError(f'{STRICT_LOAD_KEY} must be True or False, got {strict!r}')
    fit = checkpoint_fit(model, checkpoint, resume)
    action = 'resume from' if resume else 'load'
    refused = fit['run'] + (fit['tensors'] if resume else [])
    if strict:
        refused = fit['run'] + fit['record'] + fit['tensors']
    if refused:
        raise CheckpointMismatchError(
            f'{filename} does not fit the model of this config ({type(model).__name__}), so '
            f'the run does not {action} it; nothing was loaded:\n  - '
            + '\n  - '.join(refused) + f'\n{_opt_out_hint(resume)}.')
    notes = []
    let_through = fit['record'] + ([] if resume else fit['tensors'])
    if let_through:
        notes.append(f'{STRICT_LOAD_KEY}=False: {filename} does not fit the model '
                     f'({type(model).__name__}); it is {"resumed" if resume else "loaded"} '
                     f'partially, anything missing or mismatched keeps its initialised '
                     f'value:\n  - ' + '\n  - '.join(let_through))
    if not fit['recorded']:
        notes.append(f'{filename} records no operators of its LinearViT blocks (checkpoints '
                     f'of tools/train.py runs carry them in meta[{RECORD_KEY!r}]): names and '
                     f'shapes were checked, attn_type and num_heads could not be')
    for note in notes:
        runner.logger.warning(note)
    return notes
