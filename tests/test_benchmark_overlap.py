"""scripts/benchmark_overlap.py without nodes: the published table from a record, and the parameter bytes per rank of
DualPipe's two expert layouts counted on the deep MoE model."""
import sys

import pytest

from local_launch import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_overlap as bo  # noqa: E402


def test_the_table_shows_overlapped_beside_sequential_and_the_exposed_communication():
    cell = lambda step, exposed: {"step_s": step, "comm": {"0": [exposed, 0.5], "1": [exposed, 0.6]}}  # noqa: E731
    record = {"machine": "2-core test machine", "rates": ["1gbit"], "measured_rate": {"1gbit": "990 Mbit/s"},
              "results": {"deep": {"1gbit": {"overlapped": cell(0.9, 0.2), "sequential": cell(1.2, 0.7),
                                             "duplicate": cell(0.4, 0.0)}}},
              "parameter_bytes": {"deep": {"shard": 3 << 20, "duplicate": 5 << 20, "dense": 1 << 20,
                                           "experts": 4 << 20}}}
    text = "\n".join(bo.table(record))
    assert "| 1gbit | 900 | 1200 | 1.33x | 200 / 500, 200 / 600 | 700 / 500, 700 / 600 | 400 |" in text
    assert "experts shared by the copies 3.0 MiB, duplicated 5.0 MiB" in text


def test_sharing_the_experts_halves_their_bytes_per_rank():
    sizes = bo.parameter_bytes("deep")
    width, depth, experts = 256, 16, 4
    dense = depth * (width * width + width + width * experts) * 4  # each block's dense layer and gate
    assert sizes["dense"] == dense and sizes["experts"] == depth * experts * (width * width + width) * 4
    assert sizes["duplicate"] - sizes["shard"] == pytest.approx(sizes["experts"] / 2)
