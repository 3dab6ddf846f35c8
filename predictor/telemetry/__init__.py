"""Telemetry sources (NVML, Prometheus with DCGM and kube-state-metrics, Kubernetes) and the
collector that samples them into the store."""
