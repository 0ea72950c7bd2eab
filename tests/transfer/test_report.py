"""The transfer report as a table in the log."""
import logging
import re

from mmengine.logging import MMLogger

from linvit_mm.transfer import transfer_softmax_weights
from linvit_mm.transfer.report import format_transfer_report


def test_report_table_is_logged(ckpt_paths, build):
    logger = MMLogger.get_instance('test_transfer_report_table', log_level='INFO')
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        transfer_softmax_weights(build('mhla'), ckpt_paths['deit-official'], setting='mlpcopy',
                                 logger='test_transfer_report_table')
    finally:
        logger.removeHandler(handler)
    text = '\n'.join(record.getMessage() for record in records)
    assert "setting 'mlpcopy', checkpoint layout: deit-official" in text
    assert re.search(r'\| mlp +\| +72 \| +0 \| +0 \| +0 \| +0 \|', text)
    assert 'kept own init (not selected): ' in text


def _report(**changes):
    statuses = ('copied', 'analytic', 'kept own init', 'absent in checkpoint', 'not in model')
    counts = {'mlp': dict(zip(statuses, (12, 0, 0, 0, 0))),
              'attention': dict(zip(statuses, (0, 0, 8, 1, 0))),
              'head': dict(zip(statuses, (0, 0, 0, 0, 0))),
              'embedding': dict(zip(statuses, (3, 0, 0, 0, 2)))}
    report = {'setting': 'mlpcopy', 'components': None, 'source_format': 'timm',
              'prefix': 'backbone.', 'counts': counts,
              'kept own init': dict([(f'a{i}', 'not selected') for i in range(7)]
                                    + [('b0', 'operator-specific')]),
              'absent in checkpoint': ['layers.0.attn.w1'], 'not in model': ['x', 'y'],
              'unknown in checkpoint': ['u'], 'partial': {'qkv': 'rows 0:8', 'proj': 'rows 0:8'},
              'notes': ['a note']}
    report.update(changes)
    return report


def test_the_report_by_value():
    assert format_transfer_report(_report(), 'the model').splitlines() == [
        "Softmax weight transfer into the model (prefix 'backbone.'): setting 'mlpcopy', "
        'checkpoint layout: timm',
        '+-----------+--------+----------+---------------+----------------------+--------------+',
        '| component | copied | analytic | kept own init | absent in checkpoint | not in model |',
        '+-----------+--------+----------+---------------+----------------------+--------------+',
        '| mlp       |     12 |        0 |             0 |                    0 |            0 |',
        '| attention |      0 |        0 |             8 |                    1 |            0 |',
        '| embedding |      3 |        0 |             0 |                    0 |            2 |',
        '+-----------+--------+----------+---------------+----------------------+--------------+',
        '| total     |     15 |        0 |             8 |                    1 |            2 |',
        '+-----------+--------+----------+---------------+----------------------+--------------+',
        'kept own init (not selected): a0, a1, a2, a3, a4, a5, ... (+1 more)',
        'kept own init (operator-specific): b0',
        'absent in checkpoint: layers.0.attn.w1',
        'not in model: x, y',
        'unknown in checkpoint, not copied: u',
        'partly copied (rows 0:8): qkv, proj',
        'note: a note']


def test_six_names_are_shown_in_full_and_the_rarer_reason_comes_last():
    kept = dict([('b0', 'operator-specific')] + [(f'a{i}', 'not selected') for i in range(6)])
    lines = format_transfer_report(_report(**{'kept own init': kept, 'partial': {},
                                              'unknown in checkpoint': []})).splitlines()
    assert lines[10:12] == ['kept own init (not selected): a0, a1, a2, a3, a4, a5',
                            'kept own init (operator-specific): b0']
    assert not any(line.startswith(('unknown in checkpoint', 'partly copied')) for line in lines)
