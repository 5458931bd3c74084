"""The contract between a rank and the helper processes it starts.

Each helper (the monitor, the store host, the node agent) has one frozen
dataclass here that says everything it is told: :class:`MonitorConfig`,
:class:`StoreHostConfig`, :class:`NodeAgentConfig`. The rank builds one,
:class:`~inprocess.processes.helper_process.HelperProcess` starts the process
with it and stops it; the process reads it back in :func:`run_helper`, the one
``main`` of the three.

**Serialised as a command line generated from the fields.** A field
``some_name`` is the option ``--some-name=<text>``; :meth:`HelperConfig.to_argv`
writes every field that is set (``None`` is left out) and
:meth:`HelperConfig.from_argv` reads them back, and these two are the only
writer and reader. A command line rather than one JSON argument, because
``ps`` and ``/proc/<pid>/cmdline`` then show what a helper was told, field by
field; because ``--help`` of the console scripts lists every field with its
meaning and default; and because a person can run a helper by hand with the
same flags. Values are written so that they read back exactly: integers in
decimal, floats with ``repr``, booleans as ``true``/``false``.

**Units.** Every duration is a float number of seconds, and its field name ends
in ``_s``. It is turned into nanoseconds only at a call into the native
module, and into a ``timedelta`` only at a torch call.

**Validation, one way.** Each field has a type (int, float, str, bool, or one
of them ``Optional``) and a :class:`Rule`. ``__post_init__`` checks them all,
in the rank before anything starts and in the process after parsing. A bad
value raises :class:`ConfigError` naming the field, the value and what was
expected; a process given one exits with status 2 (:data:`EXIT_USAGE`).

Exit statuses shared by the three: 0 done or stopped, 2 bad input, 4 an
internal error (an exception escaped); each process adds its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import types
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self


EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERNAL = 4

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
READY = "ready"  # first word of the line a process with a ready pipe writes once it serves

_TERM, _INT, _HUP = signal.SIGTERM, signal.SIGINT, signal.SIGHUP


# -- fields and their rules -------------------------------------------------------


class ConfigError(ValueError):
    """A field of a helper's configuration has a value it cannot take."""

    def __init__(self, owner: str, name: str, value: Any, expected: str):
        self.owner, self.name, self.value, self.expected = owner, name, value, expected
        super().__init__(f"{owner}: {name}={value!r}: expected {expected}")

    def as_option(self) -> str:
        """The same, as the option of the command line: ``--name=value: expected ...``."""
        text = self.value if isinstance(self.value, str) else _to_text(self.value)
        return f"{_flag(self.name)}={text}: expected {self.expected}"


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a value of the field's type must also satisfy; ``expected`` says it in words."""

    expected: str
    holds: Callable[[Any], bool]


ANY = Rule("", lambda v: True)
POSITIVE = Rule("> 0", lambda v: v > 0)
NON_NEGATIVE = Rule(">= 0", lambda v: v >= 0)
NOT_EMPTY = Rule("that is not empty", lambda v: v != "")
NO_SLASH = Rule("without '/' (one level of a store key)", lambda v: "/" not in v)


def within(low: int, high: int) -> Rule:
    return Rule(f"in {low}..{high}", lambda v: low <= v <= high)


def one_of(*choices: str) -> Rule:
    return Rule("among " + ", ".join(choices), lambda v: v in choices)


def option(help: str, rule: Rule = ANY, default: Any = dataclasses.MISSING) -> Any:
    """A field of a helper's configuration: its help text, its rule, its default (none: required)."""
    return dataclasses.field(default=default, metadata={"help": help, "rule": rule})


_TYPE_WORDS = {int: "an int", float: "a number", str: "a string", bool: "true or false"}
_METAVARS = {int: "INT", float: "SECONDS", str: "TEXT", bool: "BOOL"}  # every float field is a duration


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _to_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _from_text(kind: type, text: str) -> Any:
    """The value of ``text`` as ``kind``; ValueError if it is not one."""
    if kind is bool:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ValueError(text)
    return kind(text)


def _typed(kind: type, value: Any) -> tuple[bool, Any]:
    """(is ``value`` a ``kind``, the value as stored): ints are accepted as floats."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, kind), value


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: type
    optional: bool
    rule: Rule
    help: str
    required: bool

    @property
    def expected(self) -> str:
        words = f"{_TYPE_WORDS[self.kind]} {self.rule.expected}".strip()
        return f"{words} or absent" if self.optional else words


_FIELDS: dict[type, tuple[_Field, ...]] = {}


def _fields_of(cls: type) -> tuple[_Field, ...]:
    cached = _FIELDS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = hints[f.name], False
        args = typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X], X | None
            (kind,) = [a for a in args if a is not type(None)]
            optional = True
        if kind not in _TYPE_WORDS:
            raise TypeError(f"{cls.__name__}.{f.name}: a helper's field is int, float, str or bool, not {kind!r}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(_Field(f.name, kind, optional, f.metadata.get("rule", ANY), f.metadata.get("help", ""), required))
    _FIELDS[cls] = tuple(out)
    return _FIELDS[cls]


# -- the configurations -------------------------------------------------------------

Config = TypeVar("Config", bound="HelperConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HelperConfig:
    """What every helper is told, and how a configuration is written, read and checked."""

    module: ClassVar[str]  # run as ``python -m <module>``
    script: ClassVar[str]  # the console script of [project.scripts]
    summary: ClassVar[str]
    stop_signals: ClassVar[frozenset[signal.Signals]] = frozenset({_TERM, _INT, _HUP})
    ignored_signals: ClassVar[frozenset[signal.Signals]] = frozenset()
    inherited_fds: ClassVar[tuple[str, ...]] = ()  # fields naming a descriptor the process inherits
    stop_grace_s: ClassVar[float] = 5.0  # SIGTERM -> SIGKILL in HelperProcess.stop

    log_level: str = option("log level", one_of(*LOG_LEVELS), default="WARNING")
    logfile: str | None = option("append the log to this file (default: stderr)", default=None)
    log_format: str | None = option("the format (logging, %%-style) of the lines on stderr: the rank passes its own "
                                       "(default, or with --logfile: time, process, pid and level)", default=None)

    def __post_init__(self) -> None:
        for f in _fields_of(type(self)):
            value = getattr(self, f.name)
            if value is None and f.optional:
                continue
            ok, value = _typed(f.kind, value)
            if not ok or not f.rule.holds(value):
                raise ConfigError(type(self).__name__, f.name, getattr(self, f.name), f.expected)
            object.__setattr__(self, f.name, value)  # an int given for a float field is stored as a float

    def log_label(self) -> str:
        """Put before the pid in every log line (``rank 3, ``)."""
        return ""

    def describe(self) -> str:
        return f"the {self.script} process"

    def to_argv(self) -> list[str]:
        return [f"{_flag(f.name)}={_to_text(getattr(self, f.name))}"
                for f in _fields_of(type(self)) if getattr(self, f.name) is not None]

    def command(self) -> list[str]:
        """How the rank starts it: this interpreter, by module name (PATH is never searched)."""
        return [sys.executable, "-m", self.module, *self.to_argv()]

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=cls.script, description=cls.summary, allow_abbrev=False,
                                    epilog=f"Also run as: python -m {cls.module}. Durations are in seconds.")
        for f in _fields_of(cls):
            default = None if f.required else getattr(cls, f.name, None)
            where = "required" if f.required else f"default: {_to_text(default) if default is not None else 'none'}"
            p.add_argument(_flag(f.name), dest=f.name, required=f.required, metavar=_METAVARS[f.kind],
                           help=f"{f.help} ({f.expected}; {where})")
        return p

    @classmethod
    def options(cls, argv: Sequence[str]) -> dict[str, str]:
        """The options given, as text (argparse exits 2 on an unknown or missing option, 0 on --help)."""
        given = vars(cls.parser().parse_args(list(argv)))
        return {name: text for name, text in given.items() if text is not None}

    @classmethod
    def from_options(cls, options: dict[str, str]) -> Self:
        values: dict[str, Any] = {}
        for f in _fields_of(cls):
            if f.name in options:
                try:
                    values[f.name] = _from_text(f.kind, options[f.name])
                except ValueError:
                    raise ConfigError(cls.__name__, f.name, options[f.name], f.expected) from None
        try:
            return cls(**values)
        except ConfigError as e:  # name the text as it was given
            raise ConfigError(e.owner, e.name, options.get(e.name, e.value), e.expected) from None

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> Self:
        return cls.from_options(cls.options(argv))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreClientConfig(HelperConfig):
    """A helper that talks to the job's store: where the server is, and which call's keys are its."""

    store_host: str = option("TCPStore server host", NOT_EMPTY)
    store_port: int = option("TCPStore server port", within(1, 65535))
    call: int = option("wrapped call index (key prefix)", NON_NEGATIVE)
    incarnation: str = option("the launcher's incarnation of the job (key prefix; '': none)", NO_SLASH, default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MonitorConfig(StoreClientConfig):
    module: ClassVar[str] = "inprocess.processes.monitor"
    script: ClassVar[str] = "inprocess-monitor"
    summary: ClassVar[str] = ("Watch one rank of an inprocess job: record its death in the store, "
                              "enforce its hard timeout.")
    # SIGINT reaches the rank's whole process group; the rank decides, the monitor follows it.
    stop_signals: ClassVar[frozenset[signal.Signals]] = frozenset({_TERM, _HUP})
    ignored_signals: ClassVar[frozenset[signal.Signals]] = frozenset({_INT})
    inherited_fds: ClassVar[tuple[str, ...]] = ("heartbeat_fd",)

    rank: int = option("initial rank of the watched rank", NON_NEGATIVE)
    heartbeat_fd: int = option("inherited descriptor of the rank's heartbeat page", NON_NEGATIVE)
    pid: int = option("pid of the rank process", POSITIVE)
    grace_s: float = option("SIGTERM -> SIGKILL grace after a hard timeout (termination_grace_time)", NON_NEGATIVE)
    kill_wait_s: float = option("after SIGKILL, how long to wait to see the death", POSITIVE, default=5.0)
    world_size: int | None = option(
        "initial world size: lets the monitor arrive at barrier 0 for a rank that died before it", POSITIVE,
        default=None)
    store_timeout_s: float = option("deadline of every store operation (and of connecting)", POSITIVE)
    barrier_timeout_s: float = option("how long to wait for a decision when counting a rank out", POSITIVE)
    heartbeat_interval_s: float = option("add 1 to inprocess/<call>/monitors/<rank> this often (0: off)",
                                         NON_NEGATIVE, default=0.0)
    heartbeat_timeout_s: float = option("count a peer out when its monitor's counter stood still this long (0: off)",
                                        NON_NEGATIVE, default=0.0)
    pidfile: str | None = option("written with the monitor's pid once it watches the rank; removed on every exit",
                                    default=None)
    join_token: str = option("the rank joins a running job with this token (control/joining.py; '': it does not)",
                             NO_SLASH, default="")
    log_level: str = option("log level", one_of(*LOG_LEVELS), default="INFO")

    def log_label(self) -> str:
        return f"rank {self.rank}, "


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreHostConfig(HelperConfig):
    module: ClassVar[str] = "inprocess.processes.store_host"
    script: ClassVar[str] = "inprocess-store-host"
    summary: ClassVar[str] = "Host the TCPStore server of an inprocess job."
    stop_grace_s: ClassVar[float] = 10.0

    port: int = option("port to listen on (0: any free port)", within(0, 65535))
    world_size: int = option("initial world size of the job", POSITIVE)
    idle_timeout_s: float = option("with the parent gone: exit when no monitor heartbeat advanced for this long",
                                   POSITIVE)
    ready_fd: int = option("write 'ready <port>' (or why not) to this descriptor, then close it (-1: none)",
                           Rule(">= -1", lambda v: v >= -1), default=-1)
    parent_pid: int = option("the process that started this one (0: none)", NON_NEGATIVE, default=0)
    check_interval_s: float = option("how often the lifetime is checked", POSITIVE, default=1.0)
    libuv: bool = option("torch's libuv server backend (false: the legacy one)", default=True)
    incarnation: str = option("the launcher's incarnation of the job (key prefix; '': from the launcher's "
                              "variables in this process's environment, if any)", NO_SLASH, default="")

    def describe(self) -> str:
        return f"the TCPStore host process for port {self.port}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeAgentConfig(StoreClientConfig):
    module: ClassVar[str] = "inprocess.processes.node_agent"
    script: ClassVar[str] = "inprocess-node-agent"
    summary: ClassVar[str] = "Carry the restart protocol's store traffic for the ranks of one node."

    node: str = option("this node's name (names the agent's socket)", NOT_EMPTY)
    slots: int = option("ranks on this node (LOCAL_WORLD_SIZE)", POSITIVE)
    store_timeout_s: float = option("deadline of every store operation", POSITIVE)
    connect_timeout_s: float = option("exit when no rank connected within this long", POSITIVE)

    def log_label(self) -> str:
        return f"node {self.node}, "


# -- the process side: one main ---------------------------------------------------


class StopRequest(threading.Event):
    """Set once the process should stop: by a stop signal (``signal`` then says
    which) or by the process itself. The first to set it decides which it was."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: signal.Signals | None = None
        self._first = threading.Lock()

    def set(self) -> None:
        with self._first:
            super().set()

    def set_by_signal(self, sig: signal.Signals) -> None:
        with self._first:
            if not self.is_set():
                self.signal = sig
                super().set()


def run_helper(config_type: type[Config], body: Callable[[Config, StopRequest], int],
               argv: Sequence[str] | None = None) -> NoReturn:
    """The ``main`` of a helper process: read and check its configuration (exit
    2 if bad), set up its log, route its stop signals to a :class:`StopRequest`,
    run ``body``, and leave with the status it returns (4 if it raised)."""
    leave(_run(config_type, body, sys.argv[1:] if argv is None else argv))


def _run(config_type: type[Config], body: Callable[[Config, StopRequest], int], argv: Sequence[str]) -> int:
    try:
        options = config_type.options(argv)
    except SystemExit as e:  # argparse printed --help, or why the command line is malformed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        config = config_type.from_options(options)
    except ConfigError as e:
        print(f"{config_type.script}: error: {e.as_option()}", file=sys.stderr)
        _tell_ready_pipe(options.get("ready_fd"), e.as_option())
        return EXIT_USAGE
    return serve_config(config, body)


def serve_config(config: Config, body: Callable[[Config, StopRequest], int]) -> int:
    """Run ``body`` with a checked config: the log set up, stop signals routed; its status (4 if it raised)."""
    try:
        _set_up_logging(config)
    except OSError as e:
        print(f"{config.script}: error: --logfile={config.logfile}: cannot open it: {e}", file=sys.stderr)
        return EXIT_USAGE
    stop = StopRequest()
    _route_stop_signals(config, stop)
    try:
        return body(config, stop)
    except Exception:
        logging.getLogger(config.module).exception("%s failed", config.script)
        return EXIT_INTERNAL


def _set_up_logging(config: HelperConfig) -> None:
    """Everything the package logs in this process goes to one handler, each line
    naming the process, its label and its pid."""
    handler: logging.Handler
    handler = logging.FileHandler(config.logfile) if config.logfile else logging.StreamHandler(sys.stderr)
    if config.log_format and not config.logfile:
        # On the rank's stderr, the lines look like the rank's own (rank_log_format).
        handler.setFormatter(logging.Formatter(config.log_format))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {config.module}[{config.log_label()}pid %(process)d] %(levelname)s %(message)s"
        ))
    package = logging.getLogger("inprocess")
    package.addHandler(handler)
    package.setLevel(config.log_level)
    package.propagate = False


def rank_log_format() -> str:
    """The format in which this process shows the ``inprocess`` logger's records, for a helper that
    writes to the same stderr: the first handler's on the way up from that logger, else what Python
    shows without any handler (the message alone). A format of another style than %% gives the
    message alone too."""
    logger: logging.Logger | None = logging.getLogger("inprocess")
    while logger is not None:
        for handler in logger.handlers:
            formatter = handler.formatter
            if formatter is None or type(formatter._style) is not logging.PercentStyle:
                return "%(message)s"
            return formatter._style._fmt or "%(message)s"
        logger = logger.parent if logger.propagate else None
    return "%(message)s"


def _route_stop_signals(config: HelperConfig, stop: StopRequest) -> None:
    """Stop signals are blocked in every thread (this runs before any other
    starts, and threads inherit the mask) and taken with ``sigwait`` on a thread
    of their own: no handler ever runs in a thread blocked in native code, and
    the native threads (the monitor's guard, torch's server) never see them."""
    for sig in config.ignored_signals:
        signal.signal(sig, signal.SIG_IGN)  # discards one pending since the start (HelperProcess.start)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, config.ignored_signals)
    stops = set(config.stop_signals)
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)

    def wait_for_one() -> None:
        stop.set_by_signal(signal.Signals(signal.sigwait(stops)))

    threading.Thread(target=wait_for_one, name=f"{config.script}-signals", daemon=True).start()


def leave(code: int) -> NoReturn:
    """Flush, then ``os._exit``: no interpreter finalisation. A helper may still
    have a thread blocked in native code when it is done (the monitor's guard in
    ``wait_event``, the node agent's broadcast on the store, torch's server
    threads); finalising would destroy objects under them, and a std::thread
    destructor run that way once aborted the monitor on SIGTERM."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def tell_ready(config: HelperConfig, detail: str) -> None:
    """Write ``ready <detail>`` to the ready pipe (if the config names one) and close it."""
    _tell_ready_pipe(getattr(config, "ready_fd", None), f"{READY} {detail}")


def tell_failed(config: HelperConfig, why: str) -> None:
    """Write why the process cannot serve to the ready pipe (if any) and close it."""
    _tell_ready_pipe(getattr(config, "ready_fd", None), why)


def _tell_ready_pipe(fd: Any, line: str) -> None:
    try:
        fd = int(fd)
    except (TypeError, ValueError):
        return
    if fd < 0:
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass  # the rank stopped waiting: it sees the exit instead
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
