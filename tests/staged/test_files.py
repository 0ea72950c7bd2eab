"""check_output_path: an output path that cannot be written is refused before any work."""
import os

import pytest

from linvit_mm.staged import check_output_path


def test_a_path_in_a_directory_yet_to_be_made_is_fine(tmp_path):
    check_output_path(tmp_path / 'not' / 'yet' / 'out.pth')
    check_output_path(tmp_path / 'out.pth', inputs=[tmp_path / 'in.pth'])


def test_an_input_that_exists_is_no_reason_to_refuse_a_new_output(tmp_path):
    source = tmp_path / 'in.pth'
    source.write_bytes(b'weights')
    check_output_path(tmp_path / 'out.pth', inputs=[source])


@pytest.mark.parametrize('case', ['directory', 'an-input', 'under-a-file'])
def test_an_output_that_cannot_be_written_is_refused(case, tmp_path):
    source = tmp_path / 'in.pth'
    source.write_bytes(b'weights')
    out, inputs, message = {
        'directory': (tmp_path, [], 'is a directory; give a file path'),
        'an-input': (tmp_path / '.' / 'in.pth', [source], 'is one of the inputs'),
        'under-a-file': (source / 'sub' / 'out.pth', [], f'{source} is a file, not a directory'),
    }[case]
    with pytest.raises(ValueError) as info:
        check_output_path(out, inputs)
    assert str(info.value).startswith(f'OUT {out} ') and message in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason='root may write anywhere')
def test_a_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / 'locked'
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match='no write permission in'):
        check_output_path(locked / 'out.pth')
