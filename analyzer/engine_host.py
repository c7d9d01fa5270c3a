"""Engine host overhead: the share of every engine step the engine core spends in Python.

From the step anatomy (``steps.step_anatomy``): ``schedule()`` plus ``update_from_output()``
against the workers' execution. While the engine core schedules and processes outputs the
model does not run, so every request's time in the engine —
the wait for the engine loop, queue, its prefill steps and the decode steps a client waits for
before it has text — is stretched by that share. The impact (``impact.REMOVED``) is what those
steps lose if the Python per step came down to a healthy one (``HEALTHY_HOST_MS``), the model
time unchanged. With async scheduling (vLLM's default on GPU) the engine core schedules a step
and processes the last one's output while the workers run the step before: that part of its
Python (``hidden``, from the step spans) keeps no worker waiting and is not counted here.
"""

from __future__ import annotations

from .findings import Context, Finding, detector, finding

#: below this the engine core's Python is not what to look at first
MIN_SHARE = 0.15
#: the engine core's Python per step on a healthy server, what a counterfactual brings it down
#: to: scheduling and processing the outputs of a batch take a few hundred µs (0.35-0.75 ms per
#: step in clean real-vLLM runs here). A floor in time, not a share: the same Python costs the
#: same beside a slow model as beside a fast one (a share floor took 5.6 ms a step as healthy
#: beside a 32-ms step and sized a planted 10 ms of output processing at less than half).
HEALTHY_HOST_MS = 1.0


@detector("engine_host_overhead")
def engine_host_overhead(ctx: Context, min_steps: int = 20) -> list[Finding]:
    a = ctx.steps.get("all")
    if not a or a["steps"] < min_steps:
        return []
    share = float(a["host_share"])
    sev = "high" if share >= 0.4 else "medium" if share >= 0.25 else "low" if share >= MIN_SHARE else None
    sched, upd, exe = a["schedule_us_per_step"] / 1e3, a["update_us_per_step"] / 1e3, a["execute_us_per_step"] / 1e3
    hidden, host = a["hidden_us_per_step"] / 1e3, a["host_us_per_step"] / 1e3
    behind = f"; {hidden:.1f} ms of it per step ran while a step was in flight (async scheduling)" if hidden else ""
    f = finding("engine_host_overhead", sev, share, "share", share,
                f"the engine core's own Python is {share:.0%} of every step (schedule {sched:.1f} ms + output "
                f"processing {upd:.1f} ms per step, against {exe:.1f} ms executing the model{behind})",
                steps=a["steps"], schedule_ms_per_step=sched, update_ms_per_step=upd, execute_ms_per_step=exe,
                hidden_ms_per_step=hidden, host_ms_per_step=host,
                prefill_steps=ctx.steps.get("prefill_steps"), decode_steps=ctx.steps.get("decode_steps"))
    return [f] if f else []
