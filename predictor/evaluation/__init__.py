"""Scoring forecasts: the forecast benchmark's backtest and the forecast-vs-actual plot."""
