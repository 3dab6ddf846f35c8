"""A model's life: training with a backtest, the registry of versions, retraining that promotes
only a better model."""
