"""What a run reports: metrics, trackers, Prometheus, alerts, hangs, profiling, memory probes."""
