"""The committed docs/img/peers.svg is what bench/peers.py draws from bench/results/, and
docs/performance.md shows it with the same ratios."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import peers

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_svg_is_what_the_results_give():
    drawn = peers.render(peers.bars())
    committed = peers.OUTPUT.read_text()
    assert drawn == committed, "docs/img/peers.svg is stale: run `.venv/bin/python -m bench.peers`"


def test_the_check_option_fails_on_a_stale_svg(tmp_path):
    stale = tmp_path / "peers.svg"
    stale.write_text(peers.OUTPUT.read_text().replace("1.96x", "2.96x"))
    assert peers.main(["--out", str(stale), "--check"]) == 1
    assert peers.main(["--out", str(peers.OUTPUT), "--check"]) == 0


def test_a_changed_result_file_changes_the_bar(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(peers.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "*.log", "*.html", "*.csv"))
    rerank = json.loads((results / "rerank-avx2.json").read_text())
    rerank["served"]["by_clients"]["64"]["pairs_per_s"] = 129.0  # 2x the in-process 64.5
    (results / "rerank-avx2.json").write_text(json.dumps(rerank))
    [bar] = [b for b in peers.bars(results) if b.source == "rerank-avx2.json"]
    assert (bar.ours, bar.peer, bar.ratio) == (129.0, 64.5, 2.0)
    assert "2.00x (129.0 / 64.5 pairs/s)" in peers.render(peers.bars(results))


def test_every_bar_comes_from_a_file_and_its_ratio_is_on_the_page():
    page = (REPO / "docs" / "performance.md").read_text()
    assert "](img/peers.svg)" in page
    for bar in peers.bars():
        assert (peers.RESULTS / bar.source).is_file(), bar.source
        assert f"{bar.ratio:.2f}x" in page, f"docs/performance.md does not give {bar.ratio:.2f}x ({bar.what})"
