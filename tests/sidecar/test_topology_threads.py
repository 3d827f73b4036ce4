"""`pdpool up` runs its engines side by side on one machine: each one's prompt steps get an
equal share of the cores, unless the engine arguments choose a thread count."""

from __future__ import annotations

import shutil

import pytest

from pdpool.cpu_cores import engine_share_of_cores, usable_cores
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec


@pytest.mark.parametrize("engines,cores,threads", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (2, 16, 8)])
def test_an_equal_share_of_the_cores(engines, cores, threads):
    assert engine_share_of_cores(engines, cores, environ={}) == threads
    assert engine_share_of_cores(engines, cores, environ={"OMP_NUM_THREADS": "4"}) is None


def _engine_argvs(tmp_path, **spec):
    topo = Topology(
        TopologySpec(
            model=str(tmp_path), log_dir=str(tmp_path / "logs"), **{**SIDE_BY_SIDE, **spec}
        )
    )
    try:
        return [c.argv for c in topo.children if c.role in ("prefill", "decode")]
    finally:
        shutil.rmtree(tmp_path / "logs", ignore_errors=True)


def test_up_gives_each_engine_its_share(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argvs = _engine_argvs(tmp_path, prefill=1, decode=2, kv_connector="none")
    assert len(argvs) == 3
    share = str(max(1, usable_cores() // 3))
    for argv in argvs:
        at = argv.index("--cpu-prefill-threads")
        assert argv[at + 1] == share


@pytest.mark.parametrize("chosen", [["--cpu-threads", "1"], ["--cpu-prefill-threads=3"]])
def test_engine_arguments_that_choose_a_count_win(tmp_path, monkeypatch, chosen):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argvs = _engine_argvs(tmp_path, engine_args=chosen, kv_connector="none")
    assert argvs
    for argv in argvs:
        assert argv[-len(chosen) :] == chosen  # the user's choice, last
        assert not any(a.startswith("--cpu-prefill-threads") for a in argv[: -len(chosen)])
