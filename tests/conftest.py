"""Every test process runs single-threaded: ranks share the machine's few cores."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
