"""paddle_graphpp: CUDA Graphs for pipeline-parallel training (PaddlePaddle first, PyTorch second).

The framework is the user's choice and is not a dependency: install paddlepaddle-gpu
(or paddlepaddle), and/or torch, the way your platform needs, or ask for the extra
(``pip install paddle_graphpp[torch]``). The tests pin the CPU builds in requirements-test.txt.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "paddle_graphpp" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="paddle_graphpp",
    version=VERSION,
    description="CUDA Graphs for pipeline-parallel training in PaddlePaddle and PyTorch",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["paddle_graphpp", "paddle_graphpp.*", "static_passes", "static_passes.*"]),
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.11"],
        "paddle": ["paddlepaddle>=3.3"],
        "hf": ["transformers>=5.0"],
        "demo": ["tqdm"],
        "test": ["pytest>=7", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["paddle-graphpp-report=paddle_graphpp.report:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Environment :: GPU :: NVIDIA CUDA",
    ],
)
