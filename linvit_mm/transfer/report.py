"""The transfer report as a table for the log."""

__all__ = ['REPORT_STATUSES', 'format_transfer_report']

# Module tensors are in exactly one of the first four; the last counts checkpoint tensors.
REPORT_STATUSES = ('copied', 'analytic', 'kept own init', 'absent in checkpoint', 'not in model')
_MAX_NAMES = 6


def _names(names):
    names = list(names)
    shown = ', '.join(names[:_MAX_NAMES])
    return shown + (f', ... (+{len(names) - _MAX_NAMES} more)' if len(names) > _MAX_NAMES else '')


def _names_by_value(mapping):
    """``{name: value}`` -> ``{value: [names]}``, in first-seen order."""
    grouped = {}
    for name, value in mapping.items():
        grouped.setdefault(value, []).append(name)
    return grouped


def format_transfer_report(report, module_name='module'):
    """Readable multi-line summary of a :func:`transfer_softmax_weights` report."""
    what = (f"setting '{report['setting']}'" if report['setting'] is not None
            else f"components {report['components']}")
    source = report['source_format'] or 'no checkpoint read'
    lines = [f"Softmax weight transfer into {module_name} (prefix '{report['prefix']}'): "
             f'{what}, checkpoint layout: {source}']
    header = ('component', ) + REPORT_STATUSES
    rows = [(group, ) + tuple(str(counts[key]) for key in REPORT_STATUSES)
            for group, counts in report['counts'].items() if any(counts.values())]
    rows.append(('total', ) + tuple(
        str(sum(counts[key] for counts in report['counts'].values())) for key in REPORT_STATUSES))
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    rule = '+' + '+'.join('-' * (w + 2) for w in widths) + '+'

    def fmt(row):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        return '| ' + ' | '.join(cells) + ' |'

    lines += [rule, fmt(header), rule] + [fmt(row) for row in rows[:-1]] + [rule, fmt(rows[-1]),
                                                                           rule]
    by_reason = _names_by_value(report['kept own init'])
    # the most common reason first
    for reason, names in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        lines.append(f'kept own init ({reason}): {_names(names)}')
    for key in ('absent in checkpoint', 'not in model'):
        if report[key]:
            lines.append(f'{key}: {_names(report[key])}')
    if report.get('unknown in checkpoint'):
        lines.append(f"unknown in checkpoint, not copied: "
                     f"{_names(report['unknown in checkpoint'])}")
    for text, names in _names_by_value(report['partial']).items():
        lines.append(f'partly copied ({text}): {_names(names)}')
    lines += [f'note: {note}' for note in report['notes']]
    return '\n'.join(lines)
