"""Evaluation, apart from the product: trace replay, the job simulator, the benchmarks, plots
and the demo. Everything here drives the product's own planner and placement code."""
