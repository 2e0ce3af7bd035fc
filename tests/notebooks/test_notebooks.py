"""The notebooks run top to bottom (nbclient, a fresh kernel each), and stay stripped.

Each notebook answers one question with real measurements on this machine and draws
its plots; running them is the slowest part of the suite, hence ``slow``. Committed
notebooks carry no outputs: ``test_notebooks_are_stripped`` keeps it that way.
"""

import doctest
import time
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
ENV = {"MPLBACKEND": "Agg", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == [
        "01_flash_attention.ipynb",
        "02_remat_policies.ipynb",
        "03_memory_planner.ipynb",
        "04_pytorch_checkpoints.ipynb",
        "05_ascend_npu.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_are_stripped(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries widget state"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
    print(f"{path.name}: {seconds:.0f} s")


def test_plot_helpers_doctests(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.syspath_prepend(str(NOTEBOOKS_DIR))
    import plots

    failures, tests = doctest.testmod(plots)
    assert tests > 0 and failures == 0
