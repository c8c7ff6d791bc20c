"""``python -m benchmarks.gpu_check`` (from the repository root): the GPU check."""

import sys

from .cli import main

sys.exit(main())
