"""Warning: the SLO file, Prometheus rules (+ promtool tests) and Alertmanager config."""
