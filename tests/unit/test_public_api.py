"""The public names of ``import shardwise``: each one what it says, whatever was touched first."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import shardwise


def test_launch_stays_the_function_after_other_names_are_touched() -> None:
    # a fresh interpreter: what was imported before decides what the package attribute holds
    code = "import shardwise as sw; sw.Trainer; sw.init; sw.LaunchError; assert callable(sw.launch)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_submodule_shadows_an_export() -> None:
    """Importing ``shardwise.X`` sets the package attribute X to the module, hiding an export X."""
    modules = {info.name for info in pkgutil.iter_modules(shardwise.__path__)}
    assert not modules & set(shardwise.__all__)


def test_dir_lists_the_api() -> None:
    assert set(shardwise.__all__) <= set(dir(shardwise))


def test_launch_refuses_what_it_cannot_send_to_the_ranks_before_starting_them() -> None:
    import threading

    import pytest

    with pytest.raises(shardwise.LaunchError, match=r"cannot send '.*<lambda>' to the ranks .*top level"):
        shardwise.launch(lambda: 1, 2)
    with pytest.raises(shardwise.LaunchError, match=r"cannot send argument 0 \(lock\)"):
        shardwise.launch(print, 2, threading.Lock())


def test_a_non_finite_stop_comes_back_from_its_one_line() -> None:
    from shardwise.engine.nonfinite import NonFinite, NonFiniteStop

    stop = NonFiniteStop(7, NonFinite("the loss and the gradient of w", stop=True))
    again = NonFiniteStop.from_message(str(stop))
    assert (again.step, again.found, str(again)) == (7, stop.found, str(stop))


def test_launch_refuses_a_function_the_ranks_cannot_import(tmp_path) -> None:
    """Defined under the main guard, it pickles by name here but the ranks never define it."""
    script = tmp_path / "guarded.py"
    script.write_text(
        "import shardwise as sw\n\n"
        "if __name__ == '__main__':\n"
        "    def main():\n"
        "        return 1\n\n"
        "    sw.launch(main, 2)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1
    assert last.startswith("shardwise.launcher.LaunchError: launch cannot send 'main'")
    assert "define it at the top level" in last and "rank 0 failed" not in result.stderr
