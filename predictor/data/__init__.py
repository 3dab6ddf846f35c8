"""Demand data: trace loaders (Philly, Helios, Alibaba openb, CSV) and the long series format
on a step grid."""
