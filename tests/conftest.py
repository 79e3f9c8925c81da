import os

import pytest
import torch

if not torch.cuda.is_available():  # GPU kernels are checked on the CPU through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER" in os.environ and not torch.cuda.is_available():
    # `make test` runs one worker per core (pytest-xdist): one torch thread each, not one per core each
    torch.set_num_threads(1)

from fixtures import Checkpoints  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))
