"""Install mmfsdp; ``requirements.txt`` lists what it needs."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


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
    python_requires='>=3.9',
    install_requires=requirements(),
    extras_require={'tests': ['pytest', 'ruff']},
    license='Apache-2.0',
)
