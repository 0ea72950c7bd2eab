"""Eager-only shortcuts (``linvit_mm.utils.tracing``): the cache that tracing neither reads nor
fills, and the switch the size-dependent branches ask."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim

from linvit_mm.utils.tracing import eager_cache, is_tracing


def counted_table():
    """A cached ``arange`` of ``n`` and the list of the ``n`` it was built for."""
    built = []

    @eager_cache(maxsize=2)
    def table(n):
        built.append(n)
        return torch.arange(n, dtype=torch.float32)

    return table, built


def test_eager_calls_share_one_tensor_and_the_least_recent_entry_goes():
    table, built = counted_table()
    first = table(3)
    assert table(3) is first and built == [3]
    table(4)
    table(3)          # 3 is now the most recent
    table(5)          # evicts 4
    assert table.cache_len() == 2 and table(3) is first
    table(4)
    assert built == [3, 4, 5, 4]
    table.cache_clear()
    assert table(3) is not first


def test_tracing_neither_reads_nor_stores_so_sizes_may_be_symbols():
    table, built = counted_table()
    cached = table(4)

    class AddTable(torch.nn.Module):

        def forward(self, x):
            assert is_tracing()
            return x + table(x.shape[0])

    for dynamic in (None, {'x': {0: Dim('n')}}):
        program = torch.export.export(AddTable(), (torch.zeros(4), ), dynamic_shapes=dynamic)
        assert table.cache_len() == 1 and table(4) is cached
    assert built == [4, 4, 4]
    # the dynamic program computes the table for any size instead of holding the example's
    torch.testing.assert_close(program.module()(torch.zeros(6)), torch.arange(6.))
    assert not is_tracing()


def test_results_that_are_not_plain_tensors_are_not_stored():
    table, built = counted_table()
    with FakeTensorMode():
        fake = table(3)
    assert type(fake) is not torch.Tensor and table.cache_len() == 0
    assert type(table(3)) is torch.Tensor and built == [3, 3]
