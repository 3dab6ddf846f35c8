"""A global PyTorch quantile network (`torch`): one small MLP for every series, horizon and
level at once.

Inputs at an anchor s are the boosting features of `features.anchor_features` (lags,
trailing-window statistics, exogenous columns, all in units of the series' scale), a window
of the last `window` values relative to y[s] in the same unit, and the anchor's calendar.
The target, as for `lgbm.QuantileBoost`, is the scaled h-step change (y[s+h] - y[s]) / scale,
for every trained horizon at once (a direct multi-horizon head). Quantiles are monotone by
construction: the lowest level plus cumulative softplus increments. The loss is the pinball
loss summed over horizons and levels.

The network is trained in float32 and answers in float64, so one anchor's forecast does not
depend on how many anchors are asked with it. Training is deterministic under `seed`
(its own generator, a fixed thread count, deterministic kernels), on the CPU unless a GPU is
present (or `device` says otherwise). The pickled model holds the weights as arrays, not the
module, so it loads wherever torch of a compatible version imports.

It exposes what `conformal.ConformalBoost` needs of a core model (`unit`, `offsets`,
`calibration_from`, `horizons`, `levels`), so `torch-conformal` is that calibration around
this network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.conformal import ConformalBoost
from predictor.models.direct import DirectForecaster, SeriesArrays, training_grid
from predictor.models.features import (
    CALENDAR,
    EXOGENOUS,
    FeatureSpec,
    anchor_features,
    causal_scale,
    series_scale,
)
from predictor.models.lgbm import _interp_rows

TORCH_PIN = "torch==2.13.0"


def import_torch() -> Any:
    """torch, or a clear InputError saying how to install the CPU build."""
    try:
        import torch
    except ImportError:
        raise InputError(
            f"the torch model needs PyTorch: pip install {TORCH_PIN} (the CPU build; "
            "or the extra gpuscale[torch])"
        ) from None
    return torch


@dataclass(frozen=True)
class NetParams:
    """Network and training settings (small: the signal is weak and the machine small)."""

    hidden: int = 128
    layers: int = 2
    dropout: float = 0.05
    epochs: int = 12
    batch_size: int = 1024
    learning_rate: float = 2e-3
    weight_decay: float = 1e-5
    seed: int = 7
    threads: int = 1
    device: str | None = None  # None: cuda when available, else cpu


class TorchQuantile(DirectForecaster):
    """The global quantile MLP on scaled h-step changes (the `torch` model).

    `holdout` keeps the last share of every series out of training (for calibration by a
    wrapper, as in `QuantileBoost`). Horizons that were not trained are interpolated in
    sqrt(h) between trained ones; levels between trained levels.
    """

    name = "torch"

    def __init__(
        self,
        horizons: Sequence[int] = (1, 3, 6, 18, 36, 72),
        levels: Sequence[float] = (0.5, 0.9, 0.99),
        *,
        window: int = 24,
        holdout: float = 0.0,
        params: NetParams | None = None,
        spec: FeatureSpec | None = None,
    ) -> None:
        self.horizons, self.levels = training_grid(horizons, levels, holdout)
        if window < 1:
            raise InputError(f"window must be >= 1, got {window}")
        import_torch()
        self.window = window
        self.holdout = holdout
        self.params = params or NetParams()
        self.spec = spec or FeatureSpec()
        self.exogenous: tuple[str, ...] = ()
        self.scales: dict[str, float] = {}
        self.calibration_from: dict[str, pd.Timestamp] = {}
        self.training_window: tuple[pd.Timestamp, pd.Timestamp] | None = None
        self.training_rows = 0
        self.device_used = ""
        self._centre = np.zeros(0)
        self._spread = np.zeros(0)
        self._weights: dict[str, np.ndarray] = {}
        self._net: Any = None  # built from _weights on first use; never pickled

    @property
    def features(self) -> list[str]:
        anchored = self.spec.names(self.exogenous)[: -len(CALENDAR)]
        back = [f"w{k}" for k in range(1, self.window + 1)]
        return [*anchored, *back, "tod_sin", "week_sin", "tod_cos", "week_cos"]

    def settings(self) -> dict[str, object]:
        return {
            "horizons": list(self.horizons),
            "levels": self.levels.tolist(),
            "window": self.window,
            "holdout": self.holdout,
            "params": asdict(self.params),
            "features": self.features,
            "device": self.device_used,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_net": None}

    # -- inputs -------------------------------------------------------------------------

    def unit(self, s: SeriesArrays) -> np.ndarray:
        """Scale of every step: the training scale of a fitted series, else the causal one."""
        if s.unique_id in self.scales:
            return np.full(s.size, self.scales[s.unique_id])
        return causal_scale(s.y)

    def _inputs(self, s: SeriesArrays, scale: np.ndarray) -> np.ndarray:
        """Raw input rows [step, feature] of every step of `s` as an anchor (row i reads
        rows <= i only)."""
        anchored = anchor_features(s.frame, scale, self.spec, self.exogenous).to_numpy(float)
        back = np.empty((s.size, self.window))
        for k in range(1, self.window + 1):
            past = np.concatenate([np.full(k, s.y[0]), s.y[:-k]])
            back[:, k - 1] = (past - s.y) / scale
        ds = pd.DatetimeIndex(s.ds)
        day = ((ds.hour * 60 + ds.minute) / 1440.0).to_numpy()
        week = (ds.dayofweek.to_numpy() + day) / 7.0
        calendar = np.stack(
            [np.sin(2 * np.pi * f) for f in (day, week)]
            + [np.cos(2 * np.pi * f) for f in (day, week)],
            axis=1,
        )
        raw = np.concatenate([anchored, back, calendar], axis=1)
        # signed log: levels of 400 nodes in units of 0.05 and changes of one unit alike
        return np.sign(raw) * np.log1p(np.abs(raw))

    def _standard(self, raw: np.ndarray) -> np.ndarray:
        out = (raw - self._centre) / self._spread
        return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)

    # -- training -----------------------------------------------------------------------

    def _fit(self, series: list[SeriesArrays]) -> None:
        self.exogenous = tuple(c for c in EXOGENOUS if any(c in s.frame for s in series))
        xs, zs = [], []
        firsts, lasts = [], []
        for s in series:
            scale = series_scale(s.y[s.observed])
            self.scales[s.unique_id] = scale
            cut = s.size - round(s.size * self.holdout)
            self.calibration_from[s.unique_id] = pd.Timestamp(s.ds[min(cut, s.size - 1)])
            firsts.append(pd.Timestamp(s.ds[0]))
            lasts.append(pd.Timestamp(s.ds[cut - 1]))
            anchors = np.arange(0, max(cut - min(self.horizons), 0))
            anchors = anchors[s.observed[anchors]]
            if anchors.size == 0:
                continue
            z = np.full((anchors.size, len(self.horizons)), np.nan)
            for j, h in enumerate(self.horizons):
                ok = anchors + h < cut
                target = anchors[ok] + h
                z[ok, j] = np.where(
                    s.observed[target], (s.y[target] - s.y[anchors[ok]]) / scale, np.nan
                )
            keep = np.isfinite(z).any(axis=1)
            xs.append(self._inputs(s, np.full(s.size, scale))[anchors[keep]])
            zs.append(z[keep])
        if not xs:
            raise InputError("history is too short to train on (no step has a target)")
        self.training_window = (min(firsts), max(lasts))
        x = np.concatenate(xs)
        z = np.concatenate(zs)
        self.training_rows = int(x.shape[0])
        self._centre = np.nanmean(x, axis=0)
        spread = np.nanstd(x, axis=0)
        self._spread = np.where(np.isfinite(spread) & (spread > 1e-9), spread, 1.0)
        self._centre = np.nan_to_num(self._centre)
        self._train(self._standard(x), z)

    def _train(self, x: np.ndarray, z: np.ndarray) -> None:
        torch = import_torch()
        p = self.params
        device = p.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device_used = device
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(p.threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(p.seed)
                gen = torch.Generator().manual_seed(p.seed)
                net = _network(torch, x.shape[1], len(self.horizons), self.levels.size, p)
                net = net.to(device)
                xt = torch.as_tensor(x, dtype=torch.float32, device=device)
                target = torch.as_tensor(np.nan_to_num(z), dtype=torch.float32, device=device)
                mask = torch.as_tensor(np.isfinite(z), dtype=torch.float32, device=device)
                levels = torch.as_tensor(self.levels, dtype=torch.float32, device=device)
                opt = torch.optim.AdamW(
                    net.parameters(), lr=p.learning_rate, weight_decay=p.weight_decay
                )
                batches = max(1, -(-x.shape[0] // p.batch_size))
                sched = torch.optim.lr_scheduler.OneCycleLR(
                    opt, max_lr=p.learning_rate, total_steps=p.epochs * batches
                )
                net.train()
                for _ in range(p.epochs):
                    order = torch.randperm(x.shape[0], generator=gen).to(device)
                    for b in range(batches):
                        idx = order[b * p.batch_size : (b + 1) * p.batch_size]
                        q = _quantile_head(torch, net(xt[idx]), len(self.horizons), levels.numel())
                        diff = target[idx].unsqueeze(-1) - q
                        loss = torch.maximum(levels * diff, (levels - 1.0) * diff)
                        loss = (loss * mask[idx].unsqueeze(-1)).sum() / mask[idx].sum().clamp(
                            min=1.0
                        )
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        sched.step()
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
        self._weights = {k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}
        self._net = None

    # -- answering ----------------------------------------------------------------------

    def _network_f64(self) -> Any:
        if self._net is None:
            torch = import_torch()
            net = _network(
                torch, self._centre.size, len(self.horizons), self.levels.size, self.params
            )
            net.load_state_dict({k: torch.as_tensor(v) for k, v in self._weights.items()})
            self._net = net.double().eval()
        return self._net

    def _trained(self, s: SeriesArrays, anchors: np.ndarray) -> np.ndarray:
        """Scaled change quantiles [anchor, trained horizon, trained level]."""
        if not self._weights:
            raise InputError(f"model {self.name!r} is not fitted")
        torch = import_torch()
        x = self._standard(self._inputs(s, self.unit(s))[anchors])
        with torch.no_grad():
            net = self._network_f64()
            out = _quantile_head(
                torch,
                net(torch.as_tensor(x, dtype=torch.float64)),
                len(self.horizons),
                self.levels.size,
            )
        return out.numpy()

    def offsets(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        """Scaled change forecasts [anchor, level] (horizons and levels interpolated)."""
        fitted = self._trained(s, anchors)
        trained = np.array(self.horizons)
        root = np.sqrt(horizon)
        if horizon > trained[-1] or horizon < trained[0]:
            edge = -1 if horizon > trained[-1] else 0
            at = fitted[:, edge, :] * np.sqrt(horizon / trained[edge])
        else:
            k = int(np.clip(np.searchsorted(trained, horizon), 1, max(trained.size - 1, 1)))
            if trained.size == 1 or trained[k] == horizon:
                at = fitted[:, k if trained.size > 1 else 0, :]
            else:
                lo, hi = np.sqrt(trained[k - 1]), np.sqrt(trained[k])
                w = (root - lo) / (hi - lo)
                at = (1 - w) * fitted[:, k - 1, :] + w * fitted[:, k, :]
        if self.levels.size == 1:
            return np.repeat(at, levels.size, axis=1)
        return _interp_rows(at, self.levels, levels)

    def _quantiles(
        self, s: SeriesArrays, anchors: np.ndarray, horizon: int, levels: np.ndarray
    ) -> np.ndarray:
        scale = self.unit(s)[anchors]
        return s.y[anchors, None] + scale[:, None] * self.offsets(s, anchors, horizon, levels)


def _network(torch: Any, inputs: int, horizons: int, levels: int, p: NetParams) -> Any:
    nn = torch.nn
    blocks: list[Any] = []
    width = inputs
    for _ in range(p.layers):
        blocks += [nn.Linear(width, p.hidden), nn.GELU(), nn.Dropout(p.dropout)]
        width = p.hidden
    blocks.append(nn.Linear(width, horizons * levels))
    return nn.Sequential(*blocks)


def _quantile_head(torch: Any, raw: Any, horizons: int, levels: int) -> Any:
    """[batch, horizon, level] quantiles, ascending in level: the lowest plus cumulative
    softplus increments."""
    raw = raw.view(-1, horizons, levels)
    if levels == 1:
        return raw
    steps = torch.nn.functional.softplus(raw[..., 1:])
    return torch.cat([raw[..., :1], raw[..., :1] + torch.cumsum(steps, dim=-1)], dim=-1)


class ConformalTorch(ConformalBoost):
    """`ConformalBoost`'s online conformal upper quantiles and shrunk median around the
    torch network instead of the boosting (the `torch-conformal` model)."""

    name = "torch-conformal"

    def __init__(
        self,
        horizons: Sequence[int] = (1, 3, 6, 18, 36, 72),
        levels: Sequence[float] = (0.5, 0.9, 0.99),
        *,
        holdout: float = 0.25,
        refit: bool = True,
        params: NetParams | None = None,
        **calibration: Any,
    ) -> None:
        super().__init__(horizons, levels, holdout=holdout, refit=refit, **calibration)
        self.core = TorchQuantile(horizons, levels, holdout=holdout, params=params)
        self.full = TorchQuantile(horizons, levels, params=params) if refit else None
