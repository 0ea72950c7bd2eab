#!/usr/bin/env python
"""linvit_mm: linear-attention Vision Transformers initialised from Softmax ViTs."""
import os
import os.path as osp
import platform
import shutil
import sys
import warnings

from setuptools import find_packages, setup

HERE = osp.dirname(osp.abspath(__file__))


def readme():
    with open(osp.join(HERE, 'README.md'), encoding='utf-8') as f:
        return f.read()


def get_version():
    scope = {}
    with open(osp.join(HERE, 'linvit_mm', 'version.py')) as f:
        exec(compile(f.read(), 'version.py', 'exec'), scope)
    return scope['__version__']


def parse_requirements(fname):
    """Requirement lines of ``requirements/<fname>`` without comments or blank lines."""
    with open(osp.join(HERE, 'requirements', fname)) as f:
        lines = (line.split('#', 1)[0].strip() for line in f)
        return [line for line in lines if line]


def add_mim_extension():
    """Expose configs/, tools/ and model-index.yml under linvit_mm/.mim, as OpenMMLab
    packages do.

    mim (list, search, train, test) and mmengine (``linvit_mm::path/to/config.py``) look
    there; mmengine reads model-index.yml before it looks for a config. An editable install
    links them (edits show at once); a wheel or sdist copies them.
    """
    if any(cmd in sys.argv for cmd in ('develop', 'editable_wheel')):
        mode = 'symlink'
    elif any(cmd in sys.argv for cmd in ('sdist', 'bdist_wheel', 'install')):
        mode = 'copy'
    else:
        return
    mim_path = osp.join(HERE, 'linvit_mm', '.mim')
    os.makedirs(mim_path, exist_ok=True)
    for name in ('configs', 'tools', 'model-index.yml'):
        src = osp.join(HERE, name)
        dst = osp.join(mim_path, name)
        if osp.isfile(dst) or osp.islink(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink' and platform.system() != 'Windows':
            os.symlink(osp.relpath(src, mim_path), dst)
        else:
            if mode == 'symlink':
                warnings.warn('no symlinks on Windows: copying configs, tools and '
                              'model-index.yml instead')
            if osp.isdir(src):
                shutil.copytree(src, dst)
            else:
                shutil.copyfile(src, dst)


if __name__ == '__main__':
    add_mim_extension()
    setup(
        name='linvit_mm',
        version=get_version(),
        description='Linear-attention ViTs initialised from Softmax ViTs, for OpenMMLab '
        '(classification, detection, segmentation)',
        long_description=readme(),
        long_description_content_type='text/markdown',
        keywords='computer vision, vision transformer, linear attention, distillation',
        packages=find_packages(exclude=('configs', 'tools', 'tests', 'tests.*')),
        include_package_data=True,
        package_data={'linvit_mm': ['.mim/configs/**/*', '.mim/tools/**/*',
                                    '.mim/model-index.yml']},
        # torch 2.14 needs 3.10; the code itself needs 3.9 (math.lcm, importlib.resources.files)
        python_requires='>=3.10',
        license='Apache License 2.0',
        classifiers=[
            'Development Status :: 3 - Alpha',
            'License :: OSI Approved :: Apache Software License',
            'Operating System :: OS Independent',
            'Programming Language :: Python :: 3',
            'Topic :: Scientific/Engineering :: Artificial Intelligence',
        ],
        install_requires=parse_requirements('runtime.txt'),
        extras_require={
            'all': parse_requirements('runtime.txt') + parse_requirements('tests.txt'),
            'tests': parse_requirements('tests.txt'),
            'mim': parse_requirements('mminstall.txt'),
        },
        zip_safe=False)
