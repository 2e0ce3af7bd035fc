"""Library argument names -> the command line's flags, for error messages.

The library names the Python argument in its errors, with its value (``steps=0 must be
a positive int``, ``process_id=3 must be < num_processes=2``). ``main`` catches an
error of a subcommand and rewrites each ``name=`` of ``FLAGS`` (merged with the
subcommand's own ``flags`` default, for names that differ between subcommands) into
the flag that sets it, so the command line says ``--steps 0 must be a positive int``.

Only ``name=`` is rewritten, never a bare word: a library message that wants its
argument mapped writes it as ``name=value`` (or ``name=`` alone, as in ``needs
checkpoint_dir=``). ``name=True`` becomes the bare flag (``--resume``), and a name
after ``.``, ``-`` or a letter (``config.max_len=``, ``q.shape=``) is left alone, and so
is anything inside a quoted value (``mesh='data=2'``).
"""

import re
from collections.abc import Mapping

FLAGS: dict[str, str] = {
    "attention": "--attention",
    "batch": "--batch",
    "budget": "--budget",
    "checkpoint.dir": "--checkpoint-dir",
    "checkpoint.every": "--checkpoint-every",
    "checkpoint.force": "--force",
    "checkpoint.resume": "--resume",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_every": "--checkpoint-every",
    "compress": "--compress",
    "compress_tags": "--compress-tags",
    "coordinator": "--coordinator",
    "context_parallel": "--context-parallel",
    "data": "--data",
    "data.eval_every": "--eval-every",
    "data.eval_path": "--eval-data",
    "data.eval_split": "--eval-split",
    "data.path": "--data",
    "data.text_per_line": "--text-per-line",
    "data.tokenizer": "--tokenizer",
    "devices": "--devices",
    "eval_data": "--eval-data",
    "eval_every": "--eval-every",
    "eval_split": "--eval-split",
    "force": "--force",
    "heartbeat_timeout": "--heartbeat-timeout",
    "init_from": "--init-from",
    "learning_rate": "--lr",
    "mesh": "--mesh",
    "micro_batches": "--micro-batches",
    "mlp_chunk": "--mlp-chunk",
    "n_layers": "--layers",
    "num_processes": "--num-processes",
    "optimizer": "--optimizer",
    "process_id": "--process-id",
    "remat": "--remat",
    "resume": "--resume",
    "seed": "--seed",
    "seq": "--seq",
    "steps": "--steps",
    "text_per_line": "--text-per-line",
    "tokenizer": "--tokenizer",
}
"""Python argument (or ``train.RunConfig`` field, dotted) -> flag, for the names every
subcommand spells alike (extend it here).

A subcommand whose flags differ (``jaxckpt convert``'s ``--config`` is a config.json, not
a model preset) adds or overrides entries with ``parser.set_defaults(flags={...})``."""


def flag_message(message: str, flags: Mapping[str, str] = FLAGS) -> str:
    """``message`` with every ``name=`` of a name in ``flags`` written as its flag.

    Args:
        message: a library error's text.
        flags: Python argument name -> command line flag.

    Returns:
        The text the command line prints.

    Example:
        >>> flag_message("process_id=3 must be < num_processes=2")
        '--process-id 3 must be < --num-processes 2'
        >>> flag_message("resume=True needs checkpoint_dir=; config.seq=4 is kept")
        '--resume needs --checkpoint-dir; config.seq=4 is kept'
    """
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    quoted = r"(?<!\w)'[^']*'|(?<!\w)\"[^\"]*\""  # a repr'd value, e.g. mesh='data=2': kept whole
    pattern = re.compile(rf"(?P<quoted>{quoted})|(?<![\w.\-])(?P<name>{names})=(?!=)(?P<true>True\b)?")

    def flag(match: re.Match) -> str:
        if match["quoted"]:
            return match["quoted"]
        following = message[match.end() : match.end() + 1]
        bare = match["true"] or not following or following.isspace() or following in ",;:.)]}"
        return flags[match["name"]] if bare else flags[match["name"]] + " "

    return pattern.sub(flag, message)
