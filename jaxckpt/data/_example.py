"""What a record becomes once tokenized (``Example``), and the error bad data raises (``DataError``)."""

from typing import NamedTuple

import numpy as np


class DataError(ValueError):
    """Bad training or evaluation data: the message names the file, and the line, row or
    field where it can. The CLI prints it as one line and exits with status 2.

    Example:
        >>> str(DataError("my.jsonl:3: not JSON (Expecting value)"))
        'my.jsonl:3: not JSON (Expecting value)'
    """


class Example(NamedTuple):
    """One tokenized document.

    Attributes:
        ids: ``int32 [n]`` token ids, special tokens included.
        loss_mask: ``bool [n]``: ``loss_mask[i]`` says whether ``ids[i]`` is a target,
            i.e. whether predicting it from ``ids[:i]`` counts in the loss
            (``loss_mask[0]`` has no predecessor and is never used).

    Example:
        >>> ex = Example(np.array([5, 6, 7], np.int32), np.array([False, True, True]))
        >>> int(ex.loss_mask[1:].sum())  # two targets: 6 after 5, 7 after 5 6
        2
    """

    ids: np.ndarray
    loss_mask: np.ndarray
