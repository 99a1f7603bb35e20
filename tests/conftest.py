"""Every test process runs single-threaded: ranks share the machine's few cores.

``scripts/test.sh`` runs the suite on two pytest workers (pytest-xdist, ``--dist loadgroup``): each test
file is one group, so a file's tests run in order on one worker and share what the file caches (an
uninterrupted reference run, say). The files that make network namespaces are one group together:
each checks that no namespace of its kind is left behind, which another's, alive beside it, would break.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

NETNS_FILES = {"test_two_hosts.py", "test_compress_link.py"}  # they create network namespaces (netns)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # run without it (-p no:xdist): nothing to group
        return
    for item in items:
        name = item.path.name
        group = "netns" if name in NETNS_FILES else f"{item.path.parent.name}/{name}"
        item.add_marker(pytest.mark.xdist_group(group))
