"""The main-thread interrupt is never delivered inside an import: a module that an exception cut
in the middle stays half-initialised (or missing) for every later iteration."""

from __future__ import annotations

import builtins
import sys
import threading
import time

import pytest

import inprocess.engine.interrupt as interrupt
from inprocess.engine.interrupt import MainThreadInterrupter
from inprocess.exception import RankShouldRestart

pytestmark = pytest.mark.timeout(30)

MODULE = "slow_module_for_interrupt"
SLOW_MODULE = """
import time
time.sleep(0.6)   # a long import, as torch._dynamo's first one is
READY = True
"""


def _fire_and_nudge(it: MainThreadInterrupter, after_s: float) -> None:
    time.sleep(after_s)
    it.fire("test restart")
    deadline = time.monotonic() + 5
    while not it.outside_fn.wait(0.02) and time.monotonic() < deadline:
        it.nudge()  # what the restart trigger does while it waits for the main thread


def _restart_during_import(tmp_path, monkeypatch) -> tuple[bool, bool]:
    """(the import returned, the module is complete in sys.modules) for a restart fired 0.2 s
    into a 0.6 s import."""
    (tmp_path / f"{MODULE}.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    it = MainThreadInterrupter()
    it.install()
    trigger = threading.Thread(target=_fire_and_nudge, args=(it, 0.2))
    imported = False
    try:
        trigger.start()
        with pytest.raises(RankShouldRestart):
            with it.running():
                __import__(MODULE)
                imported = True
                for _ in range(500):
                    time.sleep(0.01)
    finally:
        trigger.join()
        it.uninstall()
        complete = getattr(sys.modules.pop(MODULE, None), "READY", False)
    return imported, complete


def test_a_restart_during_an_import_is_delivered_once_the_import_is_done(tmp_path, monkeypatch) -> None:
    assert _restart_during_import(tmp_path, monkeypatch) == (True, True)


def test_without_the_guard_the_import_is_cut(tmp_path, monkeypatch) -> None:
    # The failure the guard prevents, shown on the same program.
    monkeypatch.setattr(interrupt, "_importing", lambda frame: False)
    assert _restart_during_import(tmp_path, monkeypatch) == (False, False)


def test_the_import_guard_sees_importlib_frames_and_nothing_else(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(builtins, "_importing", interrupt._importing, raising=False)
    (tmp_path / "frame_probe_for_interrupt.py").write_text("import sys\nSEEN = _importing(sys._getframe())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import frame_probe_for_interrupt

        assert frame_probe_for_interrupt.SEEN is True
    finally:
        sys.modules.pop("frame_probe_for_interrupt", None)
    assert interrupt._importing(sys._getframe()) is False
