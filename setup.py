"""paddle_graphpp: CUDA Graphs for pipeline-parallel training (PaddlePaddle first, PyTorch second).

The framework is the user's choice and is not a dependency: install paddlepaddle-gpu
(or paddlepaddle), and/or torch, the way your platform needs. The tests pin the CPU builds
in requirements-test.txt.
"""
from setuptools import find_packages, setup

setup(
    name="paddle_graphpp",
    version="0.1.0",
    description="CUDA Graphs for pipeline-parallel training in PaddlePaddle and PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["paddle_graphpp", "paddle_graphpp.*", "static_passes", "static_passes.*"]),
    install_requires=["numpy", "tqdm"],
    extras_require={"test": ["pytest>=7", "pytest-timeout"]},
)
