"""Every test process runs single-threaded: ranks share the machine's few cores.

``scripts/test.sh`` runs the suite on two pytest workers (pytest-xdist, ``--dist loadgroup``): each test
file is one group, so a file's tests run in order on one worker and share what the file caches (an
uninterrupted reference run, say). The files that make network namespaces are one group together:
each checks that no namespace of its kind is left behind, which another's, alive beside it, would break.

The groups are made by the scheduler below, from each test's file. xdist's own ``loadgroup`` reads
``xdist_group`` marks and appends the group to the test's ``_nodeid``, which pytest 9 no longer reads
(a node's id is ``_id`` now): with marks alone every test went to whichever worker was free, a file's
tests were split between the two, and each worker ran the reference runs its file caches again.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

NETNS_FILES = {"test_two_hosts.py", "test_compress_link.py"}  # they create network namespaces (netns)


def file_group(nodeid: str) -> str:
    """The group of a test: its folder and file, or ``netns`` for the files that make namespaces."""
    folder, _, name = nodeid.split("::")[0].rpartition("/")
    return "netns" if name in NETNS_FILES else f"{folder.rpartition('/')[2]}/{name}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: xdist's scope scheduler, a scope being a file group, sent in collection
    order: the multi-rank files (``tests/distributed``, few tests but slow ones) first, the many quick
    unit files last, where they fill the end. xdist's default, the groups with most tests first, sent
    the slowest group (``netns``, 3 tests, about 2 minutes) near the end, where it ran alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return file_group(nodeid)

    return FileGroups(config, log)
