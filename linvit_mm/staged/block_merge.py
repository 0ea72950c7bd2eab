"""Merge the checkpoints of attention-alignment jobs that each trained some blocks.

Attention alignment trains every block on the teacher's own input to it, so blocks are
independent and can be trained by separate jobs (``AttentionAligner(layers=[...])``). Each
job's checkpoint holds the whole student: its own blocks' attention trained, everything else
as copied from the teacher. :func:`merge_aligned_blocks` takes each block's attention
(``layers.N.attn.*``) from the job that trained it and the rest from the first job, after
checking that the jobs fit together and that no job holds a NaN or Inf (a job that diverged
would pass it on to the merge).
"""
import re
from typing import NamedTuple

import torch

from .record import RECORD_KEY, block_ranges, checkpoint_record

__all__ = ['merge_aligned_blocks']

ALIGN_ATTN_STAGE = 'align-attn'


def _attention_block(key, prefix):
    """The block index of an attention tensor ``{prefix}layers.N.attn.*``, else None."""
    match = re.match(re.escape(prefix) + r'layers\.(\d+)\.attn\.', key)
    return int(match.group(1)) if match else None


class _Job(NamedTuple):
    state: dict
    record: dict
    trained: list
    prefix: str
    described: dict


def _job(name, checkpoint):
    """The parts of one job's checkpoint, or a list of problems."""
    record = checkpoint_record(checkpoint)
    if record is None or record.get('stage') != ALIGN_ATTN_STAGE:
        found = 'no record' if record is None else f'stage {record.get("stage")!r}'
        return [f'{name}: not an attention-alignment checkpoint ({found}; runs of '
                f'AttentionAligner with StagedRecordHook record stage {ALIGN_ATTN_STAGE!r} '
                f'and the blocks they trained)']
    backbones = record.get('backbones') or {}
    if len(backbones) != 1:
        return [f'{name}: its record describes {len(backbones)} ViTs, expected one']
    if not isinstance(checkpoint.get('state_dict'), dict):
        return [f'{name}: holds no state_dict']
    (prefix, described), = backbones.items()
    from linvit_mm.transfer.formats import refuse_non_finite
    try:
        refuse_non_finite({key: value for key, value in checkpoint['state_dict'].items()
                           if torch.is_tensor(value)}, {}, name)
    except ValueError as err:
        return [str(err)]
    return _Job(checkpoint['state_dict'], record, list(record.get('trained_layers') or []),
                prefix, described)


def _softmax_blocks(described):
    from linvit_mm.models.attention import attention_class
    softmax = attention_class('softmax')
    return {index for index, name in enumerate(described.get('attn_types') or [])
            if issubclass(attention_class(name), softmax)}


def merge_aligned_blocks(checkpoints):
    """Merge attention-alignment checkpoints of disjoint block sets into one.

    Args:
        checkpoints (dict[str, dict]): loaded checkpoints by name (a file path, for messages),
            in order; the first one gives everything outside the trained attention.

    Returns:
        dict: ``{'state_dict': ..., 'meta': {'linvit_mm': record}}``, the record of the first
        job with ``trained_layers`` every trained block and ``merged_from`` the names.

    Raises:
        ValueError: fewer than two checkpoints; one that is not an attention-alignment
            checkpoint; checkpoints of different ViTs (record, tensor names or shapes); blocks
            trained by more than one job, or by none (Softmax blocks of a hybrid excepted);
            tensors outside the trained attention that differ between jobs (other teachers or
            initialisations); a job holding NaN or Inf values, each tensor named. Every
            problem is named; nothing is returned.
    """
    if len(checkpoints) < 2:
        raise ValueError(f'merging needs at least two checkpoints, got {len(checkpoints)}')
    jobs, problems = {}, []
    for name, checkpoint in checkpoints.items():
        job = _job(name, checkpoint)
        if isinstance(job, list):
            problems += job
        else:
            jobs[name] = job
    if problems:
        raise ValueError('cannot merge:\n  - ' + '\n  - '.join(problems))

    first_name, first = next(iter(jobs.items()))
    first_state, prefix, described = first.state, first.prefix, first.described
    num_layers = described['num_layers']
    owners = {}
    for name, job in jobs.items():
        state, trained = job.state, job.trained
        if job.prefix != prefix or job.described != described:
            problems.append(f'{name} holds another ViT than {first_name} ({job.prefix!r}: '
                            f'{job.described} vs {prefix!r}: {described})')
            continue
        if set(state) != set(first_state):
            extra = sorted(set(state) - set(first_state))[:5]
            lacking = sorted(set(first_state) - set(state))[:5]
            problems.append(f'{name} and {first_name} hold different tensors (only in {name}: '
                            f'{extra}; only in {first_name}: {lacking})')
            continue
        outside = [i for i in trained if not 0 <= i < num_layers]
        if outside:
            problems.append(f'{name} records trained blocks {outside} outside the '
                            f'{num_layers} blocks')
        for index in trained:
            owners.setdefault(index, []).append(name)
        differing = [key for key, value in state.items()
                     if _attention_block(key, prefix) is None
                     and (value.shape != first_state[key].shape
                          or not torch.equal(value, first_state[key]))]
        if differing:
            problems.append(f'{name} and {first_name} differ outside the trained attention '
                            f'({len(differing)} tensors, e.g. {differing[:4]}): they come from '
                            f'different teachers or initialisations')
    overlapping = {index: names for index, names in owners.items() if len(names) > 1}
    for index, names in sorted(overlapping.items()):
        problems.append(f'block {index} is trained in more than one checkpoint: '
                        f'{", ".join(names)}')
    # A hybrid's Softmax blocks are the teacher's own: no job aligns them by default.
    teachers_own = _softmax_blocks(described)
    missing = [index for index in range(num_layers)
               if index not in owners and index not in teachers_own]
    if missing:
        problems.append(f'blocks {block_ranges(missing)} are trained in none of the '
                        f'checkpoints; align them (layers=[...]) and merge again')
    if problems:
        raise ValueError('cannot merge:\n  - ' + '\n  - '.join(problems))

    merged = {}
    for key, value in first_state.items():
        block = _attention_block(key, prefix)
        source = first_state if block not in owners else jobs[owners[block][0]].state
        merged[key] = source[key]
    record = dict(first.record, trained_layers=sorted(owners),
                  merged_from=list(jobs))
    return dict(state_dict=merged, meta={RECORD_KEY: record})
