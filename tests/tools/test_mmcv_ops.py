"""The mmcv build compiles only the C++ ops of requirements/mmcv_ops.txt (tools/mmcv_subset.py):
every op a config under configs/ names or a module of linvit_mm / tools/ imports from
``mmcv.ops`` must be in the compiled extension, and the trimming itself keeps exactly the
bindings of the kept ops."""
import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
from mmengine.config import Config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / 'configs').rglob('*.py') if '_base_' not in p.parts)
sys.path.insert(0, str(REPO / 'tools'))
import mmcv_subset  # noqa: E402

sys.path.pop(0)


@functools.cache
def _module_graph(module_name):
    """``{top-level name: (names it refers to, ext functions it calls)}`` of an mmcv.ops module:
    every ``ext_module.<function>`` and bare name inside each top-level def, class or
    assignment."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    graph = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined = [node.name]
        elif isinstance(node, ast.Assign):       # roi_align = RoIAlignFunction.apply
            defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            continue
        names, ext = set(), set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and (
                    sub.value.id == 'ext_module'):
                ext.add(sub.attr)
            elif isinstance(sub, ast.Name):
                names.add(sub.id)
        for name in defined:
            graph[name] = (names - {name}, ext)
    return graph


def ext_functions_reached(op_name):
    """The ``mmcv._ext`` functions that ``mmcv.ops.<op_name>`` calls, directly or through the
    other functions and classes of its module (``nms`` -> ``NMSop`` -> ``ext_module.nms``).
    Empty for a name that is not an mmcv op."""
    import mmcv.ops
    obj = getattr(mmcv.ops, op_name, None)
    module = getattr(obj, '__module__', None)
    if obj is None or not (module or '').startswith('mmcv.ops.'):
        return set()
    graph = _module_graph(module)
    seen, todo, reached = set(), [op_name, getattr(obj, '__name__', op_name)], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        names, ext = graph[name]
        reached |= ext
        todo.extend(names)
    return reached


def config_types(cfg):
    """Every string ``type`` of a config, at any depth."""
    if isinstance(cfg, dict):
        found = {cfg['type']} if isinstance(cfg.get('type'), str) else set()
        for value in cfg.values():
            found |= config_types(value)
        return found
    if isinstance(cfg, (list, tuple)):
        return set().union(*map(config_types, cfg)) if cfg else set()
    return set()


def imported_mmcv_ops(path):
    """Names a Python file takes from ``mmcv.ops`` (``from mmcv.ops import X``, ``mmcv.ops.X``)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == 'mmcv.ops':
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == 'mmcv.ops':
            names.add(node.attr)
    return names


def missing_from_build(op_names):
    """``{op name: [ext functions the build lacks]}`` for the ops that reach a missing one."""
    ext = importlib.import_module('mmcv._ext')
    missing = {}
    for name in sorted(op_names):
        absent = sorted(f for f in ext_functions_reached(name) if not hasattr(ext, f))
        if absent:
            missing[name] = absent
    return missing


def test_the_reach_follows_calls_inside_an_ops_module():
    assert ext_functions_reached('nms') == {'nms'}
    # batched_nms runs the op its config's ``type`` names (eval): the config types say it
    assert ext_functions_reached('batched_nms') == set()
    assert ext_functions_reached('RoIAlign') == {'roi_align_forward', 'roi_align_backward'}
    assert ext_functions_reached('MultiScaleDeformableAttention') == {
        'ms_deform_attn_forward', 'ms_deform_attn_backward'}
    assert ext_functions_reached('nms_rotated') == {'nms_rotated'}
    assert ext_functions_reached('Conv2d') == set()   # an mmcv.cnn re-export, no op
    assert ext_functions_reached('NoSuchOp') == set()


def full_build():
    return hasattr(importlib.import_module('mmcv._ext'), 'nms_rotated')


@pytest.mark.skipif('full_build()', reason='this mmcv was built with every op')
def test_a_left_out_op_is_reported_by_name():
    # nms_rotated is not among the kept ops: what the audit would say of a config naming it
    assert missing_from_build({'nms_rotated'}) == {'nms_rotated': ['nms_rotated']}


@pytest.mark.skipif('full_build()', reason='this mmcv was built with every op')
def test_a_left_out_op_fails_clearly_when_called():
    import torch
    from mmcv.ops import nms_rotated
    with pytest.raises(NotImplementedError, match='nms_rotated was not compiled.*'
                       'LINVIT_MMCV_OPS=all'):
        nms_rotated(torch.rand(3, 5), torch.rand(3), 0.5)


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: str(p.relative_to(REPO / 'configs')))
def test_every_op_a_config_names_is_built(path):
    assert missing_from_build(config_types(Config.fromfile(str(path)).to_dict())) == {}


def test_every_op_the_code_imports_is_built():
    files = [*(REPO / 'linvit_mm').rglob('*.py'), *(REPO / 'tools').rglob('*.py'),
             *(REPO / 'tests').rglob('*.py')]
    reached = set().union(*map(imported_mmcv_ops, files))
    assert {'MultiScaleDeformableAttention', 'RoIAlign', 'nms'} <= reached
    assert missing_from_build(reached - {'nms_rotated'}) == {}


PYBIND = '''\
#include <torch/extension.h>
// a comment with a ; in it
std::string get_compiler_version();
Tensor nms(Tensor boxes, Tensor scores, float iou_threshold, int offset);
void roi_align_forward(Tensor input, Tensor rois,
                       int pool_mode, bool aligned);
std::vector<std::vector<int>> nms_match(Tensor dets, float iou_threshold);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("get_compiler_version", &get_compiler_version, "get_compiler_version");
  m.def("nms", &nms, "nms (CPU/CUDA) ", py::arg("boxes"), py::arg("scores"),
        py::arg("iou_threshold"), py::arg("offset"));
  m.def("roi_align_forward", &roi_align_forward, "roi_align forward",
        py::arg("input"), py::arg("aligned"));
  m.def("nms_match", &nms_match, "nms_match (CPU) ", py::arg("dets"));
}
'''


def test_pybind_keeps_the_declarations_and_bindings_of_kept_functions_only():
    text, bound = mmcv_subset.trim_pybind(PYBIND, {'get_compiler_version', 'roi_align_forward'})
    assert bound == {'get_compiler_version', 'roi_align_forward'}
    assert 'roi_align_forward(Tensor input, Tensor rois,\n' in text
    assert 'm.def("roi_align_forward"' in text and 'py::arg("aligned"));' in text
    assert 'nms' not in text and 'nms_match' not in text
    assert text.startswith('#include <torch/extension.h>\n') and text.rstrip().endswith('}')


def test_defined_functions_are_bodies_not_prototypes():
    source = '''
#include "pytorch_cpp_helper.hpp"
Tensor nms_impl(Tensor boxes, float iou_threshold) {
  return DISPATCH_DEVICE_IMPL(nms_impl, boxes, iou_threshold);
}
void softnms(Tensor boxes);
std::vector<std::vector<int> > nms_match(Tensor dets,
                                         float iou_threshold) {
  if (dets.numel() == 0) { return {}; }
  return nms_match_impl(dets, iou_threshold);
}
'''
    assert mmcv_subset.defined_functions(source) == {'nms_impl', 'nms_match'}


def fake_tree(root):
    pytorch = root / 'mmcv' / 'ops' / 'csrc' / 'pytorch'
    (pytorch / 'cpu').mkdir(parents=True)
    (pytorch / 'info.cpp').write_text('std::string get_compiler_version() { return "x"; }\n')
    (pytorch / 'nms.cpp').write_text('Tensor nms(Tensor boxes, Tensor scores, float iou_threshold,'
                                     ' int offset) { return boxes; }\n')
    (pytorch / 'roi_align.cpp').write_text('void roi_align_forward(Tensor input, Tensor rois,\n'
                                           'int pool_mode, bool aligned) {}\n')
    (pytorch / 'cpu' / 'nms.cpp').write_text('// cpu nms\n')
    (pytorch / 'cpu' / 'roi_align.cpp').write_text('// cpu roi_align\n')
    (pytorch / 'cpu' / 'bbox_overlaps_cpu.cpp').write_text('// cpu bbox_overlaps\n')
    # an op of its own whose name extends a kept one's
    (pytorch / 'roi_align_rotated.cpp').write_text('void roi_align_rotated_forward(Tensor x) {}\n')
    (pytorch / 'cpu' / 'roi_align_rotated.cpp').write_text('// cpu roi_align_rotated\n')
    (pytorch / 'pybind.cpp').write_text(PYBIND)
    loader = root / 'mmcv' / 'utils' / 'ext_loader.py'
    loader.parent.mkdir(parents=True)
    loader.write_text('import importlib\n\nif True:\n\n' + mmcv_subset._LOAD_EXT_STRICT)
    return pytorch


def test_trim_tree_deletes_the_sources_of_left_out_ops(tmp_path):
    pytorch = fake_tree(tmp_path)
    bound = mmcv_subset.trim_tree(tmp_path, ['roi_align'])
    assert bound == ['get_compiler_version', 'roi_align_forward']
    assert sorted(p.name for p in pytorch.glob('*.cpp')) == ['info.cpp', 'pybind.cpp',
                                                              'roi_align.cpp']
    assert sorted(p.name for p in (pytorch / 'cpu').glob('*.cpp')) == ['roi_align.cpp']
    loader = (tmp_path / 'mmcv' / 'utils' / 'ext_loader.py').read_text()
    assert '_ExtWithoutSomeOps' in loader and 'assert hasattr' not in loader


def test_trim_tree_refuses_an_unknown_op_before_changing_anything(tmp_path):
    pytorch = fake_tree(tmp_path)
    before = {p: p.read_text() for p in pytorch.rglob('*.cpp')}
    with pytest.raises(mmcv_subset.TrimError, match='no op source named roi_algn'):
        mmcv_subset.trim_tree(tmp_path, ['roi_algn'])
    assert {p: p.read_text() for p in pytorch.rglob('*.cpp')} == before


def test_the_kept_list_names_real_ops_with_a_reason_each():
    text = (REPO / 'requirements' / 'mmcv_ops.txt').read_text()
    entries = [line for line in text.splitlines() if line.strip() and not line.startswith('#')]
    assert entries and all(re.match(r'^\w+\s+# \S', line) for line in entries), entries
    kept = mmcv_subset.read_kept_ops(REPO / 'requirements' / 'mmcv_ops.txt')
    assert kept == [line.split()[0] for line in entries]


CUDABIND = '''\
#include "pytorch_device_registry.hpp"

Tensor NMSCUDAKernelLauncher(Tensor boxes, float iou_threshold);
Tensor nms_impl(Tensor boxes, float iou_threshold);

Tensor nms_cuda(Tensor boxes, float iou_threshold) {
  return NMSCUDAKernelLauncher(boxes, iou_threshold);
}
REGISTER_DEVICE_IMPL(nms_impl, CUDA, nms_cuda);

void ROIAlignForwardCUDAKernelLauncher(Tensor input, Tensor rois);
void roi_align_forward_impl(Tensor input, Tensor rois);

void roi_align_forward_cuda(Tensor input, Tensor rois) {
  ROIAlignForwardCUDAKernelLauncher(input, rois);
};

REGISTER_DEVICE_IMPL(roi_align_forward_impl, CUDA,
                     roi_align_forward_cuda);
typedef enum { SUM = 0, MEAN = 1, MAX = 2 } reduce_t;
'''


def test_registrations_keep_what_the_kept_dispatchers_reach():
    text = mmcv_subset.trim_registrations(CUDABIND, {'roi_align_forward_impl', 'nms'})
    assert 'REGISTER_DEVICE_IMPL(roi_align_forward_impl, CUDA,' in text
    assert 'void roi_align_forward_cuda(Tensor input, Tensor rois) {' in text
    assert 'void ROIAlignForwardCUDAKernelLauncher(Tensor input, Tensor rois);' in text
    assert 'void roi_align_forward_impl(Tensor input, Tensor rois);' in text
    # nms is bound but its dispatcher's nms_impl is not kept: none of its CUDA half stays
    assert 'NMS' not in text and 'nms_cuda' not in text and 'nms_impl' not in text
    assert text.startswith('#include "pytorch_device_registry.hpp"')
    assert 'typedef enum' in text and ';;' not in text


@pytest.mark.parametrize('stem, op', [
    ('roi_align', 'roi_align'), ('roi_align_cuda', 'roi_align'), ('nms_rotated', 'nms_rotated'),
    ('nms_rotated_cuda', 'nms_rotated'), ('bbox_overlaps_cpu', 'bbox_overlaps'),
    ('sparse_indice', None), ('upfirdn2d_kernel', 'upfirdn2d'),
    ('stack_ball_query_cuda', 'ball_query'), ('cudabind', None)])
def test_each_source_belongs_to_its_op(stem, op):
    ops = ['ball_query', 'bbox_overlaps', 'nms', 'nms_rotated', 'roi_align', 'sparse_pool_ops',
           'upfirdn2d']
    assert mmcv_subset._op_of(stem, ops) == op


def test_the_command_line_trims_a_tree_and_refuses_a_typo(tmp_path, capsys):
    pytorch = fake_tree(tmp_path)
    assert mmcv_subset.main([str(tmp_path), '--ops', 'roi_algn']) == 2
    assert 'no op source named roi_algn' in capsys.readouterr().err
    assert (pytorch / 'nms.cpp').exists()
    assert mmcv_subset.main([str(tmp_path), '--list']) == 0
    assert capsys.readouterr().out.split() == ['info', 'nms', 'roi_align', 'roi_align_rotated']
    assert mmcv_subset.main([str(tmp_path), '--ops', 'nms']) == 0
    assert 'binds 2 functions: get_compiler_version, nms' in capsys.readouterr().out
    assert sorted(p.name for p in pytorch.glob('*.cpp')) == ['info.cpp', 'nms.cpp', 'pybind.cpp']
    assert mmcv_subset.main([str(tmp_path / 'nothing'), '--list']) == 2
