"""Type and range checks of the switches a module is built with, from its signature.

A config can pass a switch as a word (``tie_qk='False'``, ``residual='no'``) or as ``None``
(what ``--cfg-options key=None`` gives); read by truthiness, ``'False'`` turns a switch on and
``None`` turns it off. A switch whose default is a bool is therefore a bool, a number whose
default is a number is a finite number (not a bool), a word whose default is a word is a
string; the module's own checks then say which words and ranges it takes.
"""
import inspect
import math
from numbers import Real

__all__ = ['bound_options', 'check_arguments', 'check_option_types']


def _kind_problem(value, default):
    if isinstance(default, bool):
        return None if type(value) is bool else 'True or False'
    if isinstance(default, Real):
        if isinstance(value, bool) or not isinstance(value, Real):
            return 'a number'
        return None if math.isfinite(value) else 'a finite number'
    if isinstance(default, str):
        return None if isinstance(value, str) else 'a string'
    return None


def check_option_types(owner, values, defaults):
    """Raise ``TypeError`` / ``ValueError`` naming each value of ``values`` whose kind does not
    match its entry of ``defaults`` (a switch that defaults to None is not checked)."""
    for name, value in values.items():
        if name not in defaults or value is defaults[name]:
            continue
        expected = _kind_problem(value, defaults[name])
        if expected is None:
            continue
        shown = f'{value!r} (a {type(value).__name__})'
        error = ValueError if expected == 'a finite number' and isinstance(value, Real) \
            else TypeError
        raise error(f'{owner}: {name} must be {expected}, got {shown}'
                    + (f'; its default is {defaults[name]!r}' if expected != 'a finite number'
                       else ''))


def bound_options(cls, owner, /, **kwargs):
    """``cls(**kwargs)``'s arguments with the signature's defaults filled in, type-checked
    against those defaults (:func:`check_option_types`)."""
    signature = inspect.signature(cls)
    try:
        bound = signature.bind(**kwargs)
    except TypeError as err:
        raise TypeError(f'{owner}: {err}') from None
    bound.apply_defaults()
    defaults = {name: parameter.default for name, parameter in signature.parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    check_option_types(owner, dict(bound.arguments), defaults)
    return dict(bound.arguments)


def check_arguments(function, owner, /, optional_bools=(), **values):
    """:func:`check_option_types` of ``values``, arguments of ``function``, against its
    defaults; the switches named in ``optional_bools`` default to None (decided later) and are
    None, True or False."""
    for name in optional_bools:
        value = values.pop(name)
        if value is not None and type(value) is not bool:
            raise TypeError(f'{owner}: {name} must be True, False or None (the default), got '
                            f'{value!r} (a {type(value).__name__})')
    defaults = {name: parameter.default
                for name, parameter in inspect.signature(function).parameters.items()}
    check_option_types(owner, values, defaults)
