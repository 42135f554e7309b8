"""README.md's performance table is the one benchmarks/readme_figures.py computes from the committed result
files it links: a number typed into the README, or a result file changed under it, fails here. The plot
the script draws next to it must exist."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def figures():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_computed_from_the_result_files():
    f = figures()
    readme = (ROOT / "README.md").read_text()
    expected = f"{f.BEGIN}\n{f.table()}\n{f.END}"
    assert expected in readme, "README.md's table differs: run python benchmarks/readme_figures.py --write"


def test_every_row_links_an_existing_result_file_and_the_plot_exists():
    f = figures()
    rows = f.rows()
    assert len(rows) >= 10 and any(r.section.startswith("GPU") for r in rows)
    for r in rows:
        assert (f.RESULTS / r.source).is_file(), r.source
        assert r.speedup is None or r.speedup > 0
    assert f.PLOT.is_file() and f.PLOT.stat().st_size > 10_000
