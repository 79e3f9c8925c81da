import os

import pytest
import torch

if not torch.cuda.is_available():  # GPU kernels are checked on the CPU through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER" in os.environ and not torch.cuda.is_available():
    # `make test` runs one worker per core (pytest-xdist): one torch thread each, not one per core each
    torch.set_num_threads(1)

from fixtures import Checkpoints  # noqa: E402

# The tests that take Triton's interpreter minutes (the fused runner, speculation and async steps on the CPU)
# and those marked slow. Under pytest-xdist's worksteal each worker is first handed a contiguous block of the
# collection; ``_slow_first`` puts an equal share of these at the head of every block, so the workers start
# with them and the suite ends on short tests that balance, not on one worker alone in a three-minute test.
SLOW_FILES = ("test_async_steps.py", "test_cuda_spec.py", "test_cuda_runner.py")


def _slow_first(items: list) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [it for it in items if it.path.name in SLOW_FILES or it.get_closest_marker("slow")]
    if workers < 2 or not slow:
        return
    chosen = {id(it) for it in slow}
    rest = [it for it in items if id(it) not in chosen]
    ordered, left = [], len(items)
    for k in range(workers):  # the block sizes worksteal's first distribution cuts
        size = left // (workers - k)
        mine = slow[k::workers]
        take = max(0, size - len(mine))
        ordered += mine + rest[:take]
        rest = rest[take:]
        left -= size
    ordered += rest
    items[:] = ordered


pytest_plugins = ["deadline_plugin"]  # FP4MOE_TEST_DEADLINE: the GPU parts stop in time, summary printed


def pytest_collection_modifyitems(config, items):
    _slow_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))
