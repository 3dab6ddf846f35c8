"""Capacity planning, node-pool providers, placement, the simulator, the service and the CLI.

Depends on `predictor`; `predictor` never imports from here.
"""
