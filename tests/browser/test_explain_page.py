"""The page ``jaxckpt plan --explain --plot FILE.html`` draws, loaded in real headless Chromium.

Chromium is Debian's package (``make test-browser`` installs it and runs these); where it is
absent the tests skip, saying so. Chromium runs as a command: ``--dump-dom`` gives the page
after its scripts ran (plotly draws the figure, its title included, into SVG), and
``--enable-logging=stderr`` writes every console message, errors included, as a ``CONSOLE``
line. The page logs nothing when it works.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import plan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # a Chromium start is seconds
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is absent: `make test-browser` installs Debian's chromium and runs these",
    ),
]

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=10000",
]


def chromium(page: Path, *action: str) -> tuple[str, list[str]]:
    """Chromium's stdout and its console lines for ``page``, loaded offline."""
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *action, page.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    return run.stdout, [line for line in run.stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The timeline of a small train step: two tanh layers, Adam-like state, donated."""

    def step(params, opt_state, batch):
        def loss(p):
            return jnp.mean(jnp.tanh(jnp.tanh(batch @ p["w0"]) @ p["w1"]) ** 2)

        grads = jax.grad(loss)(params)
        new = jax.tree.map(lambda p, g, m: p - 0.1 * (g + m), params, grads, opt_state)
        return new, jax.tree.map(lambda m, g: 0.9 * m + g, opt_state, grads)

    params = {
        "w0": jax.ShapeDtypeStruct((41, 53), jnp.float32),
        "w1": jax.ShapeDtypeStruct((53, 29), jnp.float32),
    }
    batch = jax.ShapeDtypeStruct((37, 41), jnp.float32)
    why = plan.explain(jax.jit(step, donate_argnums=(0, 1)), params, params, batch)
    path = tmp_path_factory.mktemp("page") / "timeline.html"
    return plan.save_timeline(why, path, title="two layers"), why


def test_the_page_draws_the_peak_without_console_errors(page):
    path, why = page
    dom, console = chromium(path, "--dump-dom")
    assert console == [], console
    assert 'class="main-svg"' in dom  # plotly ran and drew
    title = plan.format_bytes(why.peak_bytes)
    assert f"two layers: peak {title}" in dom.split('class="gtitle"', 1)[1].split("</text>", 1)[0]


def test_a_script_error_is_seen(tmp_path):
    """The check above can fail: a page whose script throws logs it."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefined_function();</script></body></html>")
    _, console = chromium(bad, "--dump-dom")
    assert any("Uncaught ReferenceError" in line for line in console)


def test_screenshot(page, tmp_path):
    path, _ = page
    shot = tmp_path / "page.png"
    chromium(path, f"--screenshot={shot}", "--window-size=1200,650", "--hide-scrollbars")
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000  # a drawn figure
