"""Load on the placement service over loopback (uvicorn in a subprocess, the 1,213-node
openb cluster): every answer is a placement or a 409, never an error. Speed is measured by
`gpuscale bench service`, not asserted here."""

from __future__ import annotations

from pathlib import Path

from scaler.evaluation.service_bench import openb_nodes, run_service_bench


def test_placements_under_load_on_the_openb_cluster_answer_without_errors(
    traces_dir: Path,
) -> None:
    nodes = openb_nodes(traces_dir / "alibaba-openb" / "openb_node_list_gpu_node.csv")
    result = run_service_bench(nodes, seconds=2.0, concurrency=8, fill=0.5)
    assert result.nodes == 1213
    assert result.errors == 0
    assert result.requests > 0 and result.placed + result.unschedulable == result.requests
    assert 0.5 <= result.filled_gpu_ratio < 0.6
    assert result.p50_ms <= result.p99_ms <= result.max_ms
