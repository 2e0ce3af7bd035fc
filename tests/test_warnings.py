"""The project's own warnings are errors in the test suite (``filterwarnings`` in pyproject.toml)."""

import warnings

import pytest

from jaxckpt._warnings import JaxckptWarning


def test_a_jaxckpt_warning_fails_a_test():
    with pytest.raises(JaxckptWarning, match="unknown field"):
        warnings.warn("unknown field", JaxckptWarning, stacklevel=1)


def test_other_warnings_stay_warnings():
    with pytest.warns(DeprecationWarning):
        warnings.warn("someone else's", DeprecationWarning, stacklevel=1)
