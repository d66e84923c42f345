"""Install mmfsdp; ``requirements.txt`` lists what it needs.

``configs/`` and ``tools/`` also ship inside the package as ``mmfsdp/.mim/``,
where mim (``mim train mmfsdp CONFIG``) and mmengine (``_base_ =
['mmfsdp::...']``) look for them. ``mmfsdp/.mim/configs`` and
``mmfsdp/.mim/tools`` are committed as relative symlinks to the top-level
folders, so an editable install (``pip install -e .``, which runs
``editable_wheel``, not ``develop``) sees the working tree, and a regular
install copies the files: setuptools follows the symlinks when it collects the
package data below. No ``develop``-only symlinking step is needed.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

#: Package data under mmfsdp/, reached through the .mim symlinks.
MIM_FILES = [
    '.mim/model-index.yml',
    '.mim/configs/**/*.py',
    '.mim/configs/**/*.yml',
    '.mim/tools/*.py',
    '.mim/tools/*.sh',
]


def requirements() -> list:
    """The non-comment lines of requirements.txt."""
    lines = (HERE / 'requirements.txt').read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith('#')]


setup(
    name='mmfsdp',
    version='0.1.0',
    description='Sharded (FSDP1/FSDP2) and data-parallel training in mmengine\'s workflow',
    long_description=(HERE / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmfsdp', 'mmfsdp.*']),
    package_data={'mmfsdp': MIM_FILES},
    python_requires='>=3.9',
    install_requires=requirements(),
    # pytest-timeout: every test has a deadline (pyproject.toml)
    # transformers: the third-party zoo of tests/dist/test_hf_zoo.py (needs no torch extra)
    # benchmarks: the peers of `python -m benchmarks.peers` (accelerate, Lightning Fabric),
    # pinned to the versions measured in docs/benchmarks.md
    extras_require={'tests': ['pytest', 'pytest-timeout', 'ruff', 'transformers==5.23.0'],
                    'benchmarks': ['accelerate==1.15.0', 'lightning==2.6.6'],
                    # docs: the documentation site (python -m sphinx -W -b html docs
                    # docs/_build/html); Sphinx 9 needs Python >= 3.11
                    'docs': ['sphinx==9.0.4', 'myst-parser==5.2.0', 'furo==2025.12.19']},
    license='Apache-2.0',
)
