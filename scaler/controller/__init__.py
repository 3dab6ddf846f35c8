"""Act: the reconcile loop (observe, forecast, plan, act, journal), the fleet it observes, the
removal order, leader election, metrics and the live configuration."""
