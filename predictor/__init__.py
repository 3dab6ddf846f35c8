"""Telemetry, trace loading, demand forecasting and the model registry.

`predictor` knows nothing of clouds or placement: `scaler` builds on it, never the reverse.
"""
