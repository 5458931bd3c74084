"""The main-thread interrupt is never delivered inside an import: a module that an exception cut
in the middle stays half-initialised (or missing) for every later iteration."""

from __future__ import annotations

import builtins
import signal
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


def _ctrl_c_and_restart_at_once(it: MainThreadInterrupter) -> BaseException:
    """Inside the function, a Ctrl-C and the restart's signal both pending on the main thread,
    as when a scheduler's SIGINT reaches every rank and a peer's leaving restarts the job:
    Python runs SIGINT's handler first (KeyboardInterrupt), the restart's just after. Returns
    what comes out of ``running()``."""
    both = {signal.SIGINT, interrupt.INTERRUPT_SIGNAL}
    main = threading.get_ident()
    try:
        with it.running():
            signal.pthread_sigmask(signal.SIG_BLOCK, both)
            try:
                it.fire("a peer left")  # sends the restart's signal: pending
                signal.pthread_kill(main, signal.SIGINT)  # pending on this thread, whatever the others block
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # both handlers run now, SIGINT's first
            for _ in range(1000):
                time.sleep(0.001)
    except BaseException as e:  # noqa: BLE001 - what came out is the result
        return e
    raise AssertionError("nothing was raised")


def test_a_ctrl_c_that_comes_with_the_restart_is_not_taken_for_it() -> None:
    """Before, running()'s exit raised RankShouldRestart on top of the KeyboardInterrupt (the
    restart was fired and not delivered yet): the engine restarted the rank, which trained on
    alone with its store gone, instead of leaving the job."""
    it = MainThreadInterrupter()
    it.install()
    try:
        out = _ctrl_c_and_restart_at_once(it)
    finally:
        it.uninstall()
    # The restart's handler runs next inside running()'s exit, where it holds back.
    assert isinstance(out, KeyboardInterrupt), f"{out!r} on top of {out.__context__!r}"
    assert it.fired and it.outside_fn.is_set() and not it.pending


def test_the_restart_is_delivered_once_when_the_function_ends_as_it_fires() -> None:
    """The handler never raises inside the interrupter's own exit (it would skip the moment the
    main thread says it left, and the trigger would wait for it): running() raises it instead."""
    it = MainThreadInterrupter()
    it.install()
    try:
        with pytest.raises(RankShouldRestart):
            with it.running():
                signal.pthread_sigmask(signal.SIG_BLOCK, {interrupt.INTERRUPT_SIGNAL})
                it.fire("restart")
                assert it.pending
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {interrupt.INTERRUPT_SIGNAL})  # the handler: nothing left to do
        time.sleep(0.01)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {interrupt.INTERRUPT_SIGNAL})
        it.uninstall()
    assert it.outside_fn.is_set() and not it.pending


def test_interrupted_by_finds_what_ends_a_rank_and_nothing_else() -> None:
    def restart_raised_while_handling(first: BaseException) -> RankShouldRestart:
        try:
            try:
                raise first
            except BaseException:
                raise RankShouldRestart("restart")  # noqa: B904 - implicit context, as the handler's raise has
        except RankShouldRestart as e:
            return e

    for leaving in (KeyboardInterrupt(), SystemExit(3), interrupt.RestartAbort("x")):
        assert interrupt.interrupted_by(restart_raised_while_handling(leaving)) is leaving
    for cleanup in (GeneratorExit(), ValueError("a peer's broken connection"), RankShouldRestart("earlier")):
        assert interrupt.interrupted_by(restart_raised_while_handling(cleanup)) is None
    # A Ctrl-C deeper in the chain (an exception raised while handling it, then the restart) counts too.
    try:
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise OSError("cleanup failed")  # noqa: B904 - implicit context, as in a user's cleanup
        except OSError:
            raise RankShouldRestart("restart")  # noqa: B904 - implicit context, as the handler's raise has
    except RankShouldRestart as e:
        assert isinstance(interrupt.interrupted_by(e), KeyboardInterrupt)
