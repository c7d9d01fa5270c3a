"""`ttftscope run` and `ttftscope sweep`: load against a deployment, stored and analysed.

A load profile (YAML or JSON) sets rate, burstiness, prompt/output lengths, duration or
prompt count and a priority class; it runs through vLLM's own benchmark. The window it ran
in is then analysed from the store (the server's plugin sent the spans there).
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from pathlib import Path

import yaml

from .loadgen import Profile, ServerGone, run_profile


class LoadError(RuntimeError):
    """The load could not be driven (server gone, benchmark failed)."""


def load_profile(path: str | Path) -> Profile:
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the profile: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile is a mapping of settings")
    known = {f.name for f in fields(Profile)} - {"priority_classes"}
    duration = doc.pop("duration_s", None)
    classes = doc.pop("priority_classes", None)
    unknown = set(doc) - known
    if unknown:
        raise ValueError(f"{path}: unknown profile keys {sorted(unknown)} "
                         f"(known: {sorted(known | {'duration_s', 'priority_classes'})})")
    types = {f.name: f.type for f in fields(Profile)}
    for k, v in list(doc.items()):
        t = str(types[k])
        if k == "name":
            doc[k] = str(v)
            continue
        if isinstance(v, str) and v.strip().lower() in ("inf", "infinity") and "float" in t:
            doc[k] = float("inf")
            continue
        if v is None and "None" in t:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{path}: {k} must be a number, got {v!r}")
        doc[k] = int(v) if t.startswith("int") else float(v)
    if classes is not None:
        if not isinstance(classes, dict) or not classes:
            raise ValueError(f"{path}: priority_classes is a mapping priority -> share, e.g. {{0: 0.2, 1: 0.8}}")
        try:
            mix = tuple((int(k), float(v)) for k, v in classes.items())
        except (TypeError, ValueError):
            raise ValueError(f"{path}: priority_classes is a mapping of integer priority -> share") from None
        if any(v <= 0 for _, v in mix) or abs(sum(v for _, v in mix) - 1) > 1e-6:
            raise ValueError(f"{path}: priority_classes shares must be positive and sum to 1")
        doc["priority_classes"] = mix
    p = Profile(**doc)
    if duration:
        if p.request_rate in (float("inf"), 0):
            raise ValueError(f"{path}: duration_s needs a finite request_rate")
        p = replace(p, num_prompts=max(1, int(float(duration) * p.request_rate)))
    if p.num_prompts < 1 or p.request_rate <= 0 or p.input_len < 1 or p.output_len < 1:
        raise ValueError(f"{path}: num_prompts, request_rate, input_len and output_len must be positive")
    return p


def drive(server_url: str, model: str, profile: Profile, server_alive=lambda: True) -> dict:
    """Run one profile; LoadError with a clear message when the server goes away."""
    t0 = time.time_ns()
    try:
        res = run_profile(server_url, model, profile, alive=server_alive)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ServerGone) or not server_alive():
            raise LoadError(f"the vLLM server exited during profile {profile.name!r}; what was collected is kept") from None
        raise LoadError(f"profile {profile.name!r} failed: {str(e)[-600:]}") from None
    res["window_ns"] = (t0, time.time_ns())
    failed = int(res.get("failed", 0) or 0)
    if failed and not server_alive():
        raise LoadError(f"the vLLM server exited during profile {profile.name!r} ({failed} requests failed); "
                        "what was collected is kept")
    return res
