"""``streamlit run`` for the UI, without streamlit's config-file pollers.

Streamlit watches each ``config.toml`` it knows of (global, project, next to the script) by
polling it every 0.2 s through a thread pool, whatever ``server.fileWatcherType`` says
(``streamlit.web.bootstrap._install_config_watchers``): ~70 wake-ups and 6-7 ms of CPU a second
in a UI nobody is looking at (this VM; ~10 and 2-2.5 ms without them), on a host it may share
with vLLM. The UI takes its whole configuration from flags, so
those watchers are left out; the rest is streamlit's own command line. A streamlit without that
function runs as it is.
"""

from __future__ import annotations

import sys


def main() -> None:
    from streamlit.web import bootstrap, cli

    if callable(getattr(bootstrap, "_install_config_watchers", None)):
        bootstrap._install_config_watchers = lambda *a, **kw: None
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    sys.exit(main())
