"""The notebooks run top to bottom (nbclient, a fresh kernel each), and stay stripped.

Each notebook answers one question with real measurements on this machine and draws
its plots. Readers run them at realistic sizes; the test runs every cell of each at tiny
sizes instead, injected papermill's way: after the notebook's one cell tagged
``parameters`` comes a cell of ``SMOKE_PARAMETERS`` that overrides its values. That is
still the slowest part of the suite, hence ``slow``. Committed notebooks carry no
outputs: ``test_notebooks_are_stripped`` keeps it that way.
"""

import ast
import doctest
import time
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
ENV = {"MPLBACKEND": "Agg", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"}
# Per notebook, the values the test runs it with: the smallest sizes at which every cell still
# runs and draws (each name must be one its parameters cell sets).
SMOKE_PARAMETERS = {
    "01_flash_attention": (
        "T_VALUES = [64, 128]\nJNN_MAX_T = 128\nFIT_FROM = 64\nTIME_T = [64, 128]\nROUNDS = 1"
    ),
    "02_remat_policies": "BATCH, SEQ = 2, 32\nSTEPS = 1",
    "03_memory_planner": (
        'CONFIG = nn.TransformerConfig.preset("llama2-7b", d_model=128, n_layers=2, n_heads=4, '
        "ffn_dim=344, vocab_size=512)\nB, T = 8, 64\nN_DEVICES = 8"
    ),
    "04_pytorch_checkpoints": "STEPS, BATCH, SEQ = 3, 2, 16",
    "05_ascend_npu": "LENGTHS = (16, 32)",
    "06_finetune": ("N_RECORDS = 40\nSTEPS, BATCH, SEQ, EVAL_EVERY, EVAL_SPLIT = 4, 2, 64, 2, 0.1\nNEW = 6"),
    "07_long_context": "SEQ = 256\nMLP_CHUNK = 64\nSTEPS = 1",
    "08_your_own_model": "IMAGE, PATCH = 8, 4\nDIM, HEADS, MLP, DEPTH = 24, 2, 40, 2\nBATCH = 2",
    "09_per_layer_plans": "N_LAYERS = 3\nBATCH, SEQ = 1, 32\nN_BUDGETS = 0",  # no sweep (test_plan_per_layer)
    "10_compressed_residuals": "SMOOTH = 5\nWORST = 3",  # reads the committed results: no training
}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == [
        "01_flash_attention.ipynb",
        "02_remat_policies.ipynb",
        "03_memory_planner.ipynb",
        "04_pytorch_checkpoints.ipynb",
        "05_ascend_npu.ipynb",
    ]
    assert sorted(SMOKE_PARAMETERS) == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_are_stripped(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries widget state"


def _assigned(source: str) -> set[str]:
    """The names a cell's top-level assignments set."""
    names = set()
    for node in ast.parse(source).body:
        for target in node.targets if isinstance(node, ast.Assign) else ():
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def with_smoke_parameters(nb, path: Path):
    """``nb`` with ``SMOKE_PARAMETERS`` injected as a cell after its one ``parameters`` cell.

    Raises AssertionError where the notebook has no such cell, several, or the injected cell
    sets a name the parameters cell does not (a renamed parameter would run at full size).
    """
    import nbformat

    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters', not one"
    source = SMOKE_PARAMETERS[path.stem]
    unknown = _assigned(source) - _assigned(nb.cells[tagged[0]].source)
    assert not unknown, f"{path.name}: its parameters cell sets no {sorted(unknown)}"
    injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, injected)
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_smoke_parameters_override_the_parameters_cell(path):
    nbformat = pytest.importorskip("nbformat")
    nb = with_smoke_parameters(nbformat.read(path, as_version=4), path)
    cells = [cell.metadata.get("tags", []) for cell in nb.cells]
    assert cells.index(["injected-parameters"]) == cells.index(["parameters"]) + 1


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    nb = with_smoke_parameters(nbformat.read(path, as_version=4), path)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{path.name}: a cell did not run"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
    print(f"{path.name}: {seconds:.0f} s")


def test_plot_helpers_doctests(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.syspath_prepend(str(NOTEBOOKS_DIR))
    import plots

    failures, tests = doctest.testmod(plots)
    assert tests > 0 and failures == 0
