"""Shared by the GPU tests (each skips itself without CUDA)."""
import pytest


@pytest.fixture
def fp32_exact():
    """TF32 off for the test: fp32 matmuls and convolutions, so graphed and eager runs compare
    to ~1e-6 (or bit for bit); the previous settings come back afterwards."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
