from pathlib import Path

import pytest

from zero_helpers import make_zero_checkpoints


@pytest.fixture(scope="session")
def zero_dir(tmp_path_factory) -> Path:
    """The DeepSpeed session of ``zero_helpers`` (stages 1-3, 2 ranks), run once for every test
    module that needs real DeepSpeed checkpoints or layer-wise saves of DeepSpeed loops."""
    return make_zero_checkpoints(tmp_path_factory.mktemp("zero"), (1, 2, 3))
