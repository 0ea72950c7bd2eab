"""What the tests, the demo and the analysis tools share: numerical comparison here, and the
generated mini datasets in :mod:`linvit_mm.testing.mini_data` (import it by that name: it
needs PIL, which these helpers do not)."""
__all__ = ['assert_rel_close', 'rel_error']


def rel_error(actual, expected):
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    denom = expected.norm()
    diff = (actual - expected).norm()
    if denom == 0:
        return diff.item()
    return (diff / denom).item()


def assert_rel_close(actual, expected, tol, name='tensor'):
    if actual.shape != expected.shape:
        raise AssertionError(f'{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}')
    err = rel_error(actual, expected)
    if not err <= tol:  # also catches NaN
        raise AssertionError(f'{name}: relative error {err:.3e} > {tol:.1e}')
    return err
