"""The transfer report as a table in the log."""
import logging
import re

from mmengine.logging import MMLogger

from linvit_mm.transfer import transfer_softmax_weights


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
