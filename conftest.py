import os
import shutil

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_netns = pytest.mark.skip(reason="needs root and `ip netns`")
    has_netns = os.geteuid() == 0 and shutil.which("ip") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "netns" in item.keywords and not has_netns:
            item.add_marker(skip_netns)
