"""The HTTP service (`gpuscale serve`): placement, kube-scheduler extender, forecasts, plan."""

from scaler.service.app import create_app

__all__ = ["create_app"]
