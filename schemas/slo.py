"""The SLO: one model for the analyzer, the alerts, the dashboards and the UI.

Two spellings of it, one meaning: a YAML file (``load_slo(path)``, every key in
``alerts/slo.example.yaml``; errors name the file, the line and what is wrong) and, for the
TTFT targets alone on a command line, ``p50=350,p95=600,p99=800`` (``SLO.parse``).
``SLO.from_arg`` takes either: every ``--slo`` flag means the same thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

QUANTILES = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p999": 0.999}
DEFAULT_TARGETS_MS = {"p50": 350.0, "p95": 600.0, "p99": 800.0}
_DURATION = re.compile(r"^\d+(ms|s|m|h|d|w)$")


class SLOFileError(ValueError):
    pass


def _key(yaml_key: str, kind: str, default=None, factory=None):
    """A field of the SLO and where it lives in the file (``section.key``, of a kind:
    pos, frac, dur, url, qmap, qmapmap): adding an SLO setting is this one line."""
    meta = {"yaml": yaml_key, "kind": kind}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class SLO:
    ttft_targets_ms: dict[str, float] = _key("ttft.targets_ms", "qmap", factory=lambda: dict(DEFAULT_TARGETS_MS))
    ttft_models: dict[str, dict[str, float]] = _key("ttft.models", "qmapmap", factory=dict)
    ttft_priorities: dict[str, dict[str, float]] = _key("ttft.priorities", "qmapmap", factory=dict)
    queue_priority_p99_ms: float = _key("queue_wait.priority_p99_ms", "pos", 200.0)
    queue_max_share: float = _key("queue_wait.max_share", "frac", 0.5)
    cold_start_max_s: float = _key("cold_start.max_s", "pos", 90.0)
    allreduce_p99_ms: float = _key("allreduce.p99_ms", "pos", 50.0)
    tpot_p99_ms: float = _key("tpot.p99_ms", "pos", 100.0)
    itl_p99_ms: float = _key("itl.p99_ms", "pos", 100.0)
    budget_objective: float = _key("error_budget.objective", "frac", 0.99)
    budget_threshold_ms: float = _key("error_budget.threshold_ms", "pos", 800.0)
    budget_window: str = _key("error_budget.window", "dur", "30d")
    alert_for: str = _key("alerts.for", "dur", "5m")
    ui_url: str = _key("alerts.ui_url", "url", "http://localhost:8501")
    runbook_url: str = _key("alerts.runbook_url", "url", "")  # default: the UI's Runbook page, {ui_url}/runbook
    webhook_url: str = _key("alerts.webhook_url", "url", "http://127.0.0.1:5001/alerts")
    group_wait: str = _key("alerts.group_wait", "dur", "30s")
    collector_max_queue_spans: int = _key("collector.max_queue_spans", "pos", 100_000)
    scale_out_kv_usage: float = _key("scale_out.kv_cache_usage", "frac", 0.8)
    kv_max_preemptions_per_min: float = _key("kv_cache.max_preemptions_per_min", "pos", 1.0)

    def __post_init__(self) -> None:
        for k, v in self.ttft_targets_ms.items():
            if k not in QUANTILES:
                raise ValueError(f"unknown SLO quantile {k!r}: use one of {', '.join(QUANTILES)}")
            if not v > 0:
                raise ValueError(f"SLO target for {k} must be > 0 ms, got {v!r}")

    @classmethod
    def parse(cls, spec: str | None) -> SLO:
        """The TTFT targets from ``p50=350,p95=600,p99=800`` (ms). As in a file, a quantile
        not given keeps its default target, and everything else keeps its default."""
        if not spec:
            return cls()
        t = {}
        for part in spec.split(","):
            k, sep, v = part.partition("=")
            try:
                t[k.strip()] = float(v)
            except ValueError:
                raise ValueError(f"invalid SLO item {part!r}: use p99=800 (ms)") from None
            if not sep:
                raise ValueError(f"invalid SLO item {part!r}: use p99=800 (ms)")
        return cls(ttft_targets_ms={**DEFAULT_TARGETS_MS, **t})

    @classmethod
    def from_arg(cls, value: str | None) -> SLO:
        """What a ``--slo`` flag holds: an SLO file (``*.yaml``/``*.yml`` or an existing
        path), or TTFT targets ``p50=350,...``; nothing means the defaults."""
        if not value:
            return cls()
        if value.endswith((".yaml", ".yml")) or ("=" not in value and Path(value).exists()):
            return load_slo(value)
        return cls.parse(value)


def default_spec() -> str:
    """The default TTFT targets as a ``--slo`` string."""
    return ",".join(f"{k}={v:g}" for k, v in DEFAULT_TARGETS_MS.items())


def _schema() -> dict:
    """section -> ("map", {key: (kind, attribute)}), from the fields' ``_key`` metadata."""
    out: dict = {"version": ("int1", None)}
    for f in fields(SLO):
        section, key = f.metadata["yaml"].split(".")
        out.setdefault(section, ("map", {}))[1][key] = (f.metadata["kind"], f.name)
    return out


_SCHEMA = _schema()


def _err(path: str, node, msg: str) -> SLOFileError:
    line = node.start_mark.line + 1 if node is not None else 1
    return SLOFileError(f"{path}:{line}: {msg}")


def _scalar(path: str, node, kind: str, where: str):
    if not isinstance(node, yaml.ScalarNode):
        raise _err(path, node, f"{where}: expected a single value, got a {'list' if isinstance(node, yaml.SequenceNode) else 'mapping'}")
    v = yaml.safe_load(yaml.serialize(node))
    if kind in ("num", "pos", "frac", "int1"):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _err(path, node, f"{where}: expected a number, got {v!r}")
        if kind == "pos" and not v > 0:
            raise _err(path, node, f"{where}: must be > 0, got {v}")
        if kind == "frac" and not 0 < v < 1:
            raise _err(path, node, f"{where}: must be between 0 and 1 (exclusive), got {v}")
        if kind == "int1" and v != 1:
            raise _err(path, node, f"{where}: only version 1 is known, got {v}")
        return float(v)
    if kind == "dur":
        if not isinstance(v, str) or not _DURATION.match(v):
            raise _err(path, node, f"{where}: expected a duration like 30s, 5m, 1h or 30d, got {v!r}")
        return v
    if kind == "url":
        if not isinstance(v, str) or not re.match(r"^https?://", v):
            raise _err(path, node, f"{where}: expected an http(s) URL, got {v!r}")
        return v
    return v


def _qmap(path: str, node, where: str) -> dict[str, float]:
    if not isinstance(node, yaml.MappingNode):
        raise _err(path, node, f"{where}: expected a mapping of quantile -> milliseconds, e.g. {{p99: 800}}")
    out = {}
    for k, v in node.value:
        if k.value not in QUANTILES:
            raise _err(path, k, f"{where}: unknown quantile {k.value!r} (use {', '.join(QUANTILES)})")
        out[k.value] = _scalar(path, v, "pos", f"{where}.{k.value}")
    return out


def load_slo(path: str | Path) -> SLO:
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SLOFileError(f"{path}: cannot read: {e.strerror}") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise SLOFileError(f"{path}:{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    slo = SLO()
    if root is None:
        return slo
    if not isinstance(root, yaml.MappingNode):
        raise _err(path, root, "the SLO file must be a mapping (key: value)")
    for k, v in root.value:
        if k.value not in _SCHEMA:
            raise _err(path, k, f"unknown key {k.value!r} (known: {', '.join(_SCHEMA)})")
        kind, sub = _SCHEMA[k.value]
        if kind == "int1":
            _scalar(path, v, "int1", k.value)
            continue
        if not isinstance(v, yaml.MappingNode):
            raise _err(path, v, f"{k.value}: expected a mapping")
        for k2, v2 in v.value:
            if k2.value not in sub:
                raise _err(path, k2, f"{k.value}: unknown key {k2.value!r} (known: {', '.join(sub)})")
            kind2, attr = sub[k2.value]
            where = f"{k.value}.{k2.value}"
            if kind2 == "qmap":
                setattr(slo, attr, {**getattr(slo, attr), **_qmap(path, v2, where)})
            elif kind2 == "qmapmap":
                if not isinstance(v2, yaml.MappingNode):
                    raise _err(path, v2, f"{where}: expected a mapping of name -> {{quantile: ms}}")
                setattr(slo, attr, {str(n.value): _qmap(path, q, f"{where}.{n.value}") for n, q in v2.value})
            else:
                setattr(slo, attr, _scalar(path, v2, kind2, where))
    return slo
